"""The KV storage formats of the generated decode attention kernels (decode.py): how many values
one lane's 16-byte load of a K or V row holds, and the source that widens such a load (four
uint32 words in registers) into fp32 values, emitted next to their use.

  fp16      8 values; word i holds elements 2i (low half) and 2i + 1 (high half).
  fp8_e5m2  16 one-byte codes; word i holds elements 4i .. 4i + 3, lowest byte first. An e5m2
            code is the top byte of an fp16 (attention/fp8.py), so a code moved into the high
            byte of a 16-bit half IS that fp16: (w << 8) & 0xFF00FF00 puts elements 4i and 4i + 2
            into the two halves of one word, w & 0xFF00FF00 elements 4i + 1 and 4i + 3. Two
            integer ops a word, then the fp16 -> fp32 conversions the fp16 format needs anyway.
            Exact for every code, inf and NaN included.
  fp8_e4m3  16 one-byte codes, laid out as e5m2's. The code's 7 magnitude bits moved to fp16
            bits 7..13 and its sign to bit 15 make an fp16 of exactly the code's value x 2^-8
            (normals: the 4 exponent bits land in the low end of fp16's 5, i.e. a bias of 15
            instead of 7; subnormals: 3 mantissa bits at fp16's subnormal scale, 2^-14 / 8 instead
            of 2^-6 / 8), so per word ((w << 7) & 0x3F803F80) | ((w << 8) & 0x80008000) gives
            elements 4i, 4i + 2 and ((w >> 1) & 0x3F803F80) | (w & 0x80008000) elements 4i + 1,
            4i + 3: five integer ops for four values. The factor 2^8 and the per-layer scale are
            not applied per value: the K side's go into q's multiplier (with the softmax scale),
            the V side's into the PV sums once per partition (`scale_factor`). Exact for every
            finite code; the NaN codes (0x7F, 0xFF), which the cache write stores only for a
            NaN key or value, widen to +-480 x scale instead of NaN (see decode_fp8.py).

Why bit manipulation rather than a 256-entry table in shared memory (one table load per value):
a warp's 32 table loads hit random banks of a 512-byte table (several-way conflicts), and at
one shared load per byte of KV the table would take as many shared-memory cycles per byte as a
V100 streams KV bytes per cycle (about 8 per SM), i.e. the decode would be bound by the table,
not by DRAM. The integer ops run on the integer pipe beside the fp32 FMAs of QK and PV.
"""

from __future__ import annotations

FP16, E5M2, E4M3 = "fp16", "fp8_e5m2", "fp8_e4m3"
KV_FORMATS = (FP16, E5M2, E4M3)
ONE_BYTE = (E5M2, E4M3)


def check_format(kv: str) -> None:
    if kv not in KV_FORMATS:
        raise ValueError(f"unknown KV storage {kv!r}; expected one of {KV_FORMATS}")


def values_per_load(kv: str) -> int:
    """KV elements in one 16-byte load."""
    check_format(kv)
    return 16 if kv in ONE_BYTE else 8


def scale_factor(kv: str) -> float:
    """What a widened value is multiplied by to be the stored value (before a layer's scale)."""
    check_format(kv)
    return 256.0 if kv == E4M3 else 1.0


def emit_widen(emit, indent: int, regs: str, name: str, kv: str) -> None:
    """Statements setting name0 .. name{n - 1} (fp32) to the n values of the load held in the
    words regs_0 .. regs_3 (uint32)."""
    if kv == FP16:
        for j in range(8):
            emit(indent, f"{name}{j} = {'half_hi' if j % 2 else 'half_lo'}({regs}_{j // 2})")
        return
    check_format(kv)
    for i in range(4):
        w, ev, od = f"{regs}_{i}", f"{name}e{i}", f"{name}o{i}"
        if kv == E5M2:
            emit(indent, f"{ev} = ({w} << 8) & 0xFF00FF00")
            emit(indent, f"{od} = {w} & 0xFF00FF00")
        else:
            emit(indent, f"{ev} = (({w} << 7) & 0x3F803F80) | (({w} << 8) & 0x80008000)")
            emit(indent, f"{od} = (({w} >> 1) & 0x3F803F80) | ({w} & 0x80008000)")
        emit(indent, f"{name}{4 * i} = half_lo({ev})")
        emit(indent, f"{name}{4 * i + 1} = half_lo({od})")
        emit(indent, f"{name}{4 * i + 2} = half_hi({ev})")
        emit(indent, f"{name}{4 * i + 3} = half_hi({od})")
