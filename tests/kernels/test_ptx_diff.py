"""scripts/ptx_diff.py: PTX listings compared by instruction counts, registers from the check's
JSON; a difference is reported and fails the exit status."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ptx_diff", ROOT / "scripts" / "ptx_diff.py")
ptx_diff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ptx_diff)

PTX = """//
.version 8.8
.target sm_70
.visible .entry k(
\t.param .u64 k_param_0
)
{
\t.reg .f32 \t%f<4>;
$L__BB0_1:
\tld.global.f32 \t%f1, [%rd1];
\t@%p1 bra \t$L__BB0_2;
\tfma.rn.f32 \t%f2, %f1, %f1, %f1;
\tret;
}
"""


def test_opcodes_ignore_names_and_count_predicated_instructions():
    ops = ptx_diff.opcodes(PTX)
    assert ops == {"ld.global.f32": 1, "bra": 1, "fma.rn.f32": 1, "ret": 1}
    renamed = PTX.replace("%f1", "%f3").replace("$L__BB0_2", "$L__BB0_9")
    assert ptx_diff.opcodes(renamed) == ops


def _write(d: Path, ptx: str, regs: int) -> Path:
    d.mkdir()
    (d / "k.abc.ptx").write_text(ptx)
    j = d / "r.json"
    j.write_text(
        json.dumps([{"name": "m.k", "signature": "void()", "registers": regs, "spill_bytes": 0}])
    )
    return j


def test_exit_status_says_whether_anything_differs(tmp_path, capsys):
    ja = _write(tmp_path / "a", PTX, 40)
    jb = _write(tmp_path / "b", PTX, 40)
    assert (
        ptx_diff.main([str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(ja), str(jb)]) == 0
    )
    jc = _write(tmp_path / "c", PTX.replace("fma.rn.f32", "mul.rn.f32"), 40)
    assert (
        ptx_diff.main([str(tmp_path / "a"), str(tmp_path / "c"), "--json", str(ja), str(jc)]) == 1
    )
    jd = _write(tmp_path / "d", PTX, 48)
    assert (
        ptx_diff.main([str(tmp_path / "a"), str(tmp_path / "d"), "--json", str(ja), str(jd)]) == 1
    )
    out = capsys.readouterr().out
    assert "fma.rn.f32" in out and "registers/spills differ" in out
