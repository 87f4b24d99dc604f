"""Quantize a float Hugging Face checkpoint folder into compressed-tensors' FP4 weight formats,
for benchmarks at real shapes (e.g. the random-weight Llama-3-8B of `common.py make-checkpoint`):
NVFP4 (`nvfp4-pack-quantized`: E2M1 values two a byte, an E4M3 scale per 16, one fp32 global
scale a tensor) or MXFP4 (`mxfp4-pack-quantized`: an E8M0 scale per 32), weights only (the
NVFP4A16 / MXFP4A16 presets, as llm-compressor's data-free schemes write them). The scales and
codes come from the library's own pieces (compressed_tensors: the preset's scheme,
generate_gparam, calculate_qparams and the packed compressor), run on `--device` one linear at a
time, shard by shard, so host memory holds one shard. The lm_head and the embeddings stay fp16;
every linear of make_awq_checkpoint.LINEARS is quantized (dense and hybrid models).

    python load_tests/make_fp4_checkpoint.py --src /tmp/voltserve-llama3-8b \
        --out /tmp/voltserve-llama3-8b-nvfp4 --format nvfp4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.make_awq_checkpoint import rewrite_linears  # noqa: E402

PRESETS = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}


def scheme_of(fmt: str):
    from compressed_tensors.quantization import preset_name_to_scheme

    if fmt not in PRESETS:
        raise ValueError(f"unknown FP4 format {fmt!r}; choose from {sorted(PRESETS)}")
    return preset_name_to_scheme(PRESETS[fmt], ["Linear"])


def quantize(w: torch.Tensor, scheme, fmt: str) -> dict[str, torch.Tensor]:
    """The compressed tensors of one linear's weight [N, K] (weight_packed, weight_scale and,
    NVFP4, weight_global_scale), by the library's rules, moved to the CPU."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = scheme.weights
    N, K = w.shape
    if K % args.group_size:
        raise ValueError(f"in features {K} are not a multiple of the group {args.group_size}")
    w = w.float()
    groups = w.view(N, K // args.group_size, args.group_size)
    gs = generate_gparam(w.min(), w.max()) if fmt == "nvfp4" else None
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
    state = {"weight": w, "weight_scale": scale}
    if gs is not None:
        state["weight_global_scale"] = gs
    comp_cls = NVFP4PackedCompressor if fmt == "nvfp4" else MXFP4PackedCompressor
    return {k: v.cpu() for k, v in comp_cls.compress(state, scheme).items()}


def quantization_config(scheme, fmt: str, ignore: list[str] | None = None) -> dict:
    """compressed-tensors' quantization_config of a weights-only FP4 folder; `ignore`: modules
    besides the lm_head left float."""
    wire = f"{fmt}-pack-quantized"
    group = json.loads(scheme.model_dump_json())
    group.update(format=wire)
    return {
        "quant_method": "compressed-tensors",
        "format": wire,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", *(ignore or [])],
    }


def convert(src: Path, out: Path, fmt: str = "nvfp4", device: str = "cpu") -> dict:
    """Write the `fmt` checkpoint of the float folder `src` into `out` (reused when its marker
    says it already holds exactly that); returns the marker with the write time."""
    scheme = scheme_of(fmt)
    return rewrite_linears(
        src,
        out,
        {"src": str(src), "format": fmt},
        "voltserve_fp4.json",
        lambda module, w: quantize(w.to(device), scheme, fmt),
        lambda cfg: quantization_config(scheme, fmt),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=sorted(PRESETS), default="nvfp4")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    convert(Path(args.src), Path(args.out), args.format, args.device)


if __name__ == "__main__":
    main()
