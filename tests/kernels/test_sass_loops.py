"""scripts/sass_loops.py: loops found in a disassembly by their backward branches, and the
whole path (check-kernels' PTX, ptxas, nvdisasm) on one small registered kernel."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sass_loops", ROOT / "scripts" / "sass_loops.py")
sass_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_loops)

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/               @P0 FFMA R4, R2, R2, R4 ;
        /*0030*/                   IADD3 R3, R3, 0x4, RZ ;
        /*0040*/               @!P1 BRA `(.L_x_0) ;
        /*0050*/                   BRA `(.L_x_1) ;
.L_x_1:
        /*0060*/                   EXIT ;
"""


def test_loops_are_backward_branches_with_their_opcodes():
    total, found = sass_loops.loops(SASS)
    assert total == 7
    assert [(a, b) for a, b, _ in found] == [(1, 4)]  # the forward branch is no loop
    assert found[0][2] == {"LDS": 1, "FFMA": 1, "IADD3": 1, "BRA": 1}


@pytest.mark.skipif(
    not (sass_loops.find_ptxas() and sass_loops.find_nvdisasm()), reason="needs ptxas, nvdisasm"
)
def test_counts_a_registered_kernel():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run(
        [sys.executable, "-P", str(ROOT / "scripts" / "sass_loops.py"), "--only", "gated_rms"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [x for x in proc.stdout.splitlines() if "gated_rms_norm_kernel" in x]
    assert len(lines) == 2 and all(" instructions, " in x for x in lines), proc.stdout
    assert "  loop " in proc.stdout, proc.stdout
