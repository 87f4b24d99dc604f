"""Quantize a float Hugging Face checkpoint folder into AutoAWQ's GEMM format (int4, zero
point, group g), for benchmarks at real shapes (e.g. the random-weight Llama-3-8B of
`common.py make-checkpoint`). Round-to-nearest min/max quantization per group (no activation-
aware search: the weights are random); packing follows AutoAWQ's layout: qweight int32 [K, N/8]
and qzeros int32 [K/g, N/8] with 8 nibbles per word in the order 0,2,4,6,1,3,5,7, scales fp16
[K/g, N]. The lm_head and embeddings stay fp16.

Hybrid checkpoints (Qwen3.5, Qwen3-Next): the Gated DeltaNet projections are quantized too;
the conv1d, A_log, dt_bias and norms stay float.

MoE checkpoints (Qwen3-MoE, Mixtral-style per-expert tensors): every expert's projections
(model.layers.N.mlp.experts.E.gate_proj/up_proj/down_proj) are linears of these names and are
quantized like a dense MLP's; the router (mlp.gate) is not one of them and stays float, and is
listed in modules_to_not_convert as AutoAWQ lists it. `--skip NAME,...` keeps more modules
float (whole dotted components of the module name, the loader's rule for
modules_to_not_convert: base.module_listed): `--skip self_attn` quantizes the experts (and dense
MLPs) only.

    python load_tests/make_awq_checkpoint.py --src /tmp/voltserve-llama3-8b \
        --out /tmp/voltserve-llama3-8b-awq --group 128
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from voltserve.services.executor.quant.base import module_listed

LINEARS = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    # the Gated DeltaNet projections of the hybrid families (Qwen3.5's four, Qwen3-Next's two)
    *("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba"),
    "out_proj",
)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq(v: torch.Tensor) -> torch.Tensor:
    """[R, N] 4-bit values (int32) -> [R, N/8] int32, nibble i = column 8c + AWQ_ORDER[i]."""
    R, N = v.shape
    v = v.view(R, N // 8, 8)
    out = torch.zeros(R, N // 8, dtype=torch.int64, device=v.device)
    for i, col in enumerate(AWQ_ORDER):
        out |= v[:, :, col].long() << (4 * i)
    # the word's bit pattern as int32 (nibble 7 may set the sign bit, as in AutoAWQ's files)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def quantize(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    N, K = w.shape
    x = w.float().view(N, K // group, group)
    lo = x.amin(-1).clamp_max(0)
    hi = x.amax(-1).clamp_min(0)
    s = ((hi - lo) / 15).clamp_min(1e-5).half().float()
    z = torch.round(-lo / s).clamp(0, 15)
    q = (torch.round(x / s[..., None]) + z[..., None]).clamp(0, 15).to(torch.int32)
    return {
        "qweight": pack_awq(q.view(N, K).t().contiguous()).cpu(),
        "qzeros": pack_awq(z.to(torch.int32).t().contiguous()).cpu(),
        "scales": s.t().contiguous().half().cpu(),
    }


def rewrite_linears(
    src: Path,
    out: Path,
    want: dict,
    marker_name: str,
    quantize_linear: Callable[[str, torch.Tensor], dict[str, torch.Tensor] | None],
    quantization_config: Callable[[dict], dict],
) -> dict:
    """Write a quantized copy of the float folder `src` into `out`, shard by shard (host memory
    holds one shard): every `<module>.weight` of LINEARS goes through quantize_linear(module,
    weight), whose tensors (named `<module>.<key>`) replace it, or which returns None to keep it
    float; the other tensors and files are copied; config.json gets quantization_config(its
    dict). Reused when the marker `marker_name` says `out` already holds `want`; returns that
    marker with the write time."""
    marker = out / marker_name
    if marker.is_file() and json.loads(marker.read_text()) == want:
        print(f"{out}: already holds {want}")
        return {**want, "reused": True}
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    # A conversion that stops half way must not leave a marker saying the folder is complete.
    marker.unlink(missing_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, out / f.name)
    weight_map: dict[str, str] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                t = st.get_tensor(name)
                parts = name.rsplit(".", 2)
                packed = None
                if len(parts) == 3 and parts[1] in LINEARS and parts[2] == "weight":
                    packed = quantize_linear(f"{parts[0]}.{parts[1]}", t)
                if packed is None:
                    tensors[name] = t
                else:
                    for k, v in packed.items():
                        tensors[f"{parts[0]}.{parts[1]}.{k}"] = v.contiguous()
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, f.name))
        print(f"{f.name}: {len(tensors)} tensors")
    if (src / "model.safetensors.index.json").is_file():
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
        )
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for stale in out.glob("voltserve_*.json"):  # the float folder's markers (preset, bench)
        stale.unlink()
    marker.write_text(json.dumps(want))
    write_s = time.perf_counter() - t0
    print(f"wrote {out} in {write_s:.1f} s")
    return {**want, "reused": False, "write_s": write_s}


def convert(
    src: Path, out: Path, group: int = 128, device: str = "cpu", skip: tuple[str, ...] = ()
) -> dict:
    """Write the AWQ g`group` checkpoint of the float folder `src` into `out` (reused when its
    marker says it already holds exactly that); returns the marker with the write time."""
    want = {"src": str(src), "group": group}
    if skip:
        want["skip"] = list(skip)
    model_type = json.loads((src / "config.json").read_text()).get("model_type", "")
    # An MoE router (mlp.gate) is not among LINEARS and stays float; AutoAWQ lists it in
    # modules_to_not_convert. Modules it names stay float, by the loader's own rule, so the
    # file holds float weights exactly where the loader will look for them.
    not_convert = (["mlp.gate"] if "moe" in model_type else []) + list(skip)

    def linear(module: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        return None if module_listed(module, not_convert) else quantize(w.to(device), group)

    def config(cfg: dict) -> dict:
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": not_convert or None,
        }

    return rewrite_linears(src, out, want, "voltserve_awq.json", linear, config)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--skip", default="", help="modules kept float (dotted names, comma list)")
    args = p.parse_args(argv)
    skip = tuple(x for x in args.skip.split(",") if x)
    convert(Path(args.src), Path(args.out), args.group, args.device, skip)


if __name__ == "__main__":
    main()
