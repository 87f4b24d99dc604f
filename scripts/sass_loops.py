"""Count the machine instructions of registered kernels, loop by loop, without a GPU: each
kernel's cc 7.0 PTX (`voltserve check-kernels --ptx-dir`) is assembled by ptxas for an
architecture (default sm_90, as an H100's driver assembles it at load; nvdisasm of CUDA 13
no longer reads sm_70) and disassembled, and every loop (a backward branch) is printed with
its size and its most common opcodes.

    python scripts/sass_loops.py --only gdn_chunk_scan [--arch sm_90] [--keep DIR]

What it is for: a kernel whose inner loop takes ten instructions an FMA is issue-bound whatever
its memory does, and numba's array indexing (negative-index wraparound, 64-bit strides
re-multiplied in every guarded block) is the usual cause; this shows it before a GPU is at
hand. Needs ptxas (nvidia-cuda-nvcc, which numba-cuda[cu12] installs) and nvdisasm (on PATH,
or the copy bundled with triton).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from voltserve.kernels.runtime.check import find_ptxas

INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\.(L_x_\d+):")
BRANCH = re.compile(r"BRA\s+`\(\.(L_x_\d+)\)")


def find_nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import triton

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        return str(cand) if cand.is_file() else None
    except ImportError:
        return None


def opcode(instr: str) -> str:
    """The opcode of a SASS instruction without its predicate and modifiers."""
    return re.sub(r"^@!?U?P\w+\s+", "", instr).split()[0].split(".")[0]


def loops(sass: str) -> tuple[int, list[tuple[int, int, collections.Counter]]]:
    """(instruction count, [(first, last, opcode counts) of every loop]) of a disassembly."""
    labels: dict[str, int] = {}
    instrs: list[str] = []
    for line in sass.splitlines():
        if m := LABEL.match(line.strip()):
            labels[m.group(1)] = len(instrs)
        elif m := INSTR.match(line):
            instrs.append(m.group(2))
    found = []
    for j, ins in enumerate(instrs):
        m = BRANCH.search(ins)
        if m and labels.get(m.group(1), j + 1) <= j:
            first = labels[m.group(1)]
            found.append((first, j, collections.Counter(map(opcode, instrs[first : j + 1]))))
    return len(instrs), found


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", required=True, help="kernel name part (repeatable)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--keep", help="write the PTX and SASS here instead of a temporary folder")
    args = ap.parse_args(argv)
    ptxas, nvdisasm = find_ptxas(), find_nvdisasm()
    if not ptxas or not nvdisasm:
        raise SystemExit(f"sass_loops: needs ptxas ({ptxas}) and nvdisasm ({nvdisasm})")
    out = Path(args.keep or tempfile.mkdtemp(prefix="sass_loops_"))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    cmd = [sys.executable, "-P", "-m", "voltserve.cli", "check-kernels", "--cc", "7.0"]
    cmd += ["--no-ptxas", "--ptx-dir", str(out)] + [f"--only={o}" for o in args.only]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    for ptx in sorted(out.glob("*.ptx")):
        cubin = ptx.with_suffix(f".{args.arch}.cubin")
        info = subprocess.run(
            [ptxas, f"-arch={args.arch}", "-v", str(ptx), "-o", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        regs = re.search(r"Used (\d+) registers", info)
        dis = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True)
        sass = dis.stdout
        ptx.with_suffix(f".{args.arch}.sass").write_text(sass)
        total, found = loops(sass)
        print(f"{ptx.stem}: {total} instructions, {regs.group(1) if regs else '?'} registers")
        for first, last, ops in found:
            top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
            print(f"  loop {first}-{last}: {last - first + 1} instructions ({top})")


if __name__ == "__main__":
    main(sys.argv[1:])
