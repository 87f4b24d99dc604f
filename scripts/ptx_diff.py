"""Compare two `voltserve check-kernels --ptx-dir` folders kernel by kernel: the PTX
instructions counted by opcode, and (with the check's --json files) ptxas registers and spills.

    python scripts/ptx_diff.py BEFORE_DIR AFTER_DIR [--json BEFORE.json AFTER.json]

For changes meant to leave the generated code alone (compile time, refactors): exit status 0 when
every kernel present in both folders has the same instruction counts and register figures."""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def opcodes(ptx: str) -> collections.Counter:
    """Instructions of a PTX listing by opcode (predicates, labels, directives and comments
    left out; register names and operands do not count, so renumbering is no difference)."""
    ops: collections.Counter = collections.Counter()
    for raw in ptx.splitlines():
        line = raw.strip()
        if line.startswith("@"):  # predicated instruction: drop the guard
            line = line.split(None, 1)[1] if " " in line else ""
        if not line or line.startswith(("//", ".", "{", "}", "(", ")", "$")) or line.endswith(":"):
            continue
        ops[line.split()[0].rstrip(";")] += 1
    return ops


def _registers(path: str | None) -> dict[tuple[str, str], tuple]:
    if path is None:
        return {}
    return {
        (r["name"], r["signature"]): (r["registers"], r["spill_bytes"])
        for r in json.loads(Path(path).read_text())
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--json", nargs=2, metavar=("BEFORE", "AFTER"), help="the check's --json files")
    args = ap.parse_args(argv)
    differ = 0
    files = sorted(args.before.glob("*.ptx"))
    for f in files:
        g = args.after / f.name
        if not g.exists():
            print(f"only before: {f.name}")
            continue
        a, b = opcodes(f.read_text()), opcodes(g.read_text())
        if a != b:
            differ += 1
            delta = {k: b[k] - a[k] for k in sorted(set(a) | set(b)) if a[k] != b[k]}
            print(f"differ: {f.name} ({sum(a.values())} -> {sum(b.values())} instructions) {delta}")
    regs_a, regs_b = (
        _registers(args.json[0] if args.json else None),
        _registers(args.json[1] if args.json else None),
    )
    for key, ra in regs_a.items():
        rb = regs_b.get(key)
        if rb is not None and rb != ra:
            differ += 1
            print(f"registers/spills differ: {key[0]} {key[1]}: {ra} -> {rb}")
    print(f"{len(files)} kernels compared, {differ} differences")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
