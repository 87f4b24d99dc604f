"""MoE decode speed: a Qwen3-30B-A3B-shaped model (hidden 2048, 32 q / 4 kv heads of 128, 128
experts of intermediate 768, top-8, vocab 151936) with random fp16 weights, through the engine
(CUDA graphs, the fused MoE kernels), against the floor counted from the bytes one decode step
actually reads and against transformers on the same card and the same weights.

The model has `--layers` of the real 48 decoder layers (default 8: the full model's 61 GB of
fp16 would take minutes to write and load); every floor below is counted for the layers that
are there, so the ratios carry over, and the JSON also states the full 48-layer floor.

Floors (the copy bandwidth of the same run, measured with a device-to-device copy):
- batch 1: per layer the attention weights (q, k, v, o, norms), the router and the 8 routed
  experts' gate/up/down, then the final norm and the lm_head (the embedding is a row gather).
- batched (`--batch-sizes 64,256`): the same with the expected number of distinct experts a
  batch of B tokens touches under uniform routing, E * (1 - (1 - k/E)^B) per layer (125.2 of 128
  at B = 64, all of them at 256), plus the KV cache read at the batch's context.

transformers runs first on the model it was just built with (its default experts implementation
is recorded), then the engine loads the checkpoint written from it.

int4 experts (`--quantization awq`): after the fp16 runs, the same checkpoint is quantized into
AutoAWQ's GEMM format, int4 with group `--group-size` (default 128; load_tests/
make_awq_checkpoint.py: round-to-nearest min/max per group), and the engine runs it the same way
(batch 1, then the batch sizes), in the same process, so `int4.speedup_vs_fp16` compares two
figures of one run on one card. `--int4-modules experts` (default) quantizes the experts only
(attention stays fp16, modules_to_not_convert); `all` the attention projections too. The router,
norms, embedding and lm_head stay fp16 either way. The int4 floor counts the bytes of the
engine's packed form (kernels/linear/quant_pack.py: 8 codes per int32 word, a scale and an offset in
the run dtype per group, the zero point folded into the offset), the experts' part checked against
the loaded layers' buffers: an expert of Qwen3-30B-A3B is 3 x 2048 x 768 x (1/2 + 4/128) bytes,
0.27 of its fp16 bytes. With fp16 attention and lm_head, the floor itself allows 1.41x fp16 at 8 layers and 1.78x
at 48 (`int4.floor_speedup_vs_fp16`, `int4.floor.full_model_speedup_vs_fp16`); with `all`, 1.77x
and 2.91x.

    python load_tests/bench_moe.py --layers 8 --batch-sizes 64,256 --out results/bench_moe.json
    python load_tests/bench_moe.py --layers 8 --quantization awq --model-dir /tmp/moe \
        --out results/bench_moe_int4.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.bench_decode import (  # noqa: E402
    _summarise,
    _TimingStreamer,
    batched_max_tokens,
    engine_batched,
    make_engine,
    random_prompt,
    run_single,
)
from load_tests.common import (  # noqa: E402
    dtype_name,
    env_info,
    measure_copy_bandwidth,
    resolve_device,
    resolve_dtype,
    synchronize,
    write_json,
    write_synthetic_tokenizer,
)

logger = logging.getLogger("bench_moe")

FULL_LAYERS = 48
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
)
# A CPU-sized model of the same structure, for the smoke test of this script.
TINY = dict(
    QWEN3_30B_A3B,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
)
SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "tiny": TINY}
MARKER = "voltserve_moe_bench.json"


def make_config(layers: int, dtype: torch.dtype, shape: str = "qwen3-30b-a3b"):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(num_hidden_layers=layers, **SHAPES[shape])
    cfg.dtype = dtype
    return cfg


def bytes_read(cfg, dtype: torch.dtype, layers: int, experts_per_layer: float) -> dict[str, float]:
    """Weight bytes one decode step reads with `experts_per_layer` distinct experts a layer."""
    size = torch.tensor([], dtype=dtype).element_size()
    H, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attn = (H * (q + 2 * kv) + q * H + 2 * hd + 2 * H) * size  # qkv, o, q/k norm, 2 layer norms
    router = cfg.num_experts * H * size
    expert = 3 * H * cfg.moe_intermediate_size * size
    head = (cfg.vocab_size * H + H) * size
    per_layer = attn + router + experts_per_layer * expert
    return {
        "attention_per_layer": attn,
        "router_per_layer": router,
        "expert_bytes": expert,
        "experts_per_layer": experts_per_layer,
        "lm_head_and_norm": head,
        "total": layers * per_layer + head,
    }


INT4_SKIP = {"experts": ("self_attn",), "all": ()}  # --int4-modules -> modules kept fp16


def int4_bytes_read(
    cfg, dtype: torch.dtype, layers: int, experts_per_layer: float, group: int, modules: str
) -> dict[str, float]:
    """bytes_read for the int4 g`group` checkpoint as the engine holds it
    (kernels/linear/quant_pack.py: per weight [N, K] the codes, N x K/8 int32 words, and a scale and
    an offset per group in the run dtype). modules: "experts" (attention fp16) or "all" (attention
    int4 too)."""
    size = torch.tensor([], dtype=dtype).element_size()

    def packed(n: int, k: int) -> int:
        if k % group:
            raise ValueError(f"group size {group} does not divide K={k}")
        return n * (-(-k // 8)) * 4 + 2 * n * (k // group) * size

    fp = bytes_read(cfg, dtype, layers, experts_per_layer)
    H, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attn = fp["attention_per_layer"]
    if modules == "all":
        attn = packed(q + 2 * kv, H) + packed(H, q) + (2 * hd + 2 * H) * size
    expert = packed(2 * inter, H) + packed(H, inter)
    per_layer = attn + fp["router_per_layer"] + experts_per_layer * expert
    return {
        **fp,
        "attention_per_layer": attn,
        "expert_bytes": expert,
        "expert_bytes_fp16_fraction": expert / fp["expert_bytes"],
        "total": layers * per_layer + fp["lm_head_and_norm"],
    }


def loaded_expert_bytes(engine) -> float | None:
    """Bytes of one expert's packed tensors (codes, scales, offsets of w13 and w2) as the
    engine's MoE layers hold them; None when no layer holds group-quantized experts."""
    per = set()
    for m in engine.runner.model.modules():
        if hasattr(m, "w13_qweight"):
            fields = [f"{p}_{f}" for p in ("w13", "w2") for f in ("qweight", "scales", "offsets")]
            total = sum(getattr(m, f).numel() * getattr(m, f).element_size() for f in fields)
            per.add(total / m.num_experts)
    if len(per) > 1:
        raise ValueError(f"the MoE layers' experts differ in size: {sorted(per)}")
    return per.pop() if per else None


def fused_int4_decode_layers(engine, k: int) -> str:
    """ "served/total": how many MoE layers' batch-1 steps the fused int4 kernels
    (kernels/moe/quant_decode.py) take, read after the engine ran (each layer makes their flat
    weights on first use); the rest dequantize (services/executor/quant/experts.py)."""
    from voltserve.kernels.moe import quant_decode as mq

    layers = [m for m in engine.runner.model.modules() if hasattr(m, "w13_qweight")]
    served = 0
    for m in layers:
        fw = getattr(m, "flat_weights", None)
        if fw:
            x = torch.empty(1, m.hidden, dtype=fw[0].dtype, device=fw[0].device)
            served += bool(mq.supports(x, *fw, k))
    return f"{served}/{len(layers)}"


def distinct_experts(E: int, k: int, B: int) -> float:
    return E * (1.0 - (1.0 - k / E) ** B)


def build_hf_model(cfg, device: str, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.9, 1.1, generator=gen)  # finite activations in fp16
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def write_checkpoint(model, cfg, out: Path, seed: int, shape: str) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    # transformers writes the experts back in the published per-expert layout
    # (mlp.experts.N.gate_proj/up_proj/down_proj), which the loader stacks again.
    model.save_pretrained(out, max_shard_size="4GB")
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id).save_pretrained(
        out
    )
    write_synthetic_tokenizer(out, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    marker = {"layers": cfg.num_hidden_layers, "seed": seed, "shape": shape}
    (out / MARKER).write_text(json.dumps(marker))


def checkpoint_matches(path: Path, layers: int, seed: int, shape: str) -> bool:
    m = path / MARKER
    want = {"layers": layers, "seed": seed, "shape": shape}
    return m.is_file() and json.loads(m.read_text()) == want


def hf_decode(model, device: str, prompts: list[list[int]], args) -> dict[str, Any]:
    """transformers generate on the in-memory model: decode time from first to last token."""
    gen_kw: dict[str, Any] = dict(
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        do_sample=False,
        pad_token_id=model.config.eos_token_id,
    )
    runs, first_tokens = [], []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=device)
            streamer = _TimingStreamer()
            synchronize(device)
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer, **gen_kw)
            synchronize(device)
            n = len(streamer.tokens)
            decode_s = streamer.stamps[-1] - streamer.stamps[0]
            runs.append(
                {
                    "warmup": i < args.hf_warmup,
                    "ttft_ms": (streamer.stamps[0] - start) * 1e3,
                    "decode_s": decode_s,
                    "decode_tok_s": (n - 1) / decode_s if decode_s > 0 else None,
                    "ms_per_token": decode_s / (n - 1) * 1e3 if n > 1 else None,
                }
            )
            if i == args.hf_warmup:
                first_tokens = streamer.tokens
    impl = getattr(model.config, "_experts_implementation_internal", None) or getattr(
        model.config, "_experts_implementation", None
    )
    return {
        "experts_implementation": impl,
        "runs": runs,
        "first_measured_tokens": first_tokens,
        **_summarise(runs),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help=f"decoder layers (of {FULL_LAYERS})")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--model-dir", help="reuse (or write once into) this checkpoint folder")
    p.add_argument("--keep-model", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--hf-runs", type=int, default=2)
    p.add_argument("--hf-warmup", type=int, default=1)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--context", type=int, default=512, help="prompt length of batched mode")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--decode-warmup", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--bandwidth-bytes", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantization",
        choices=["none", "awq"],
        default="none",
        help="awq: then the same model with int4 experts (AWQ GEMM), in the same run",
    )
    p.add_argument("--group-size", type=int, default=128, help="int4 group (--quantization)")
    p.add_argument("--int4-modules", choices=sorted(INT4_SKIP), default="experts")
    p.add_argument(
        "--quant-dir", help="int4 checkpoint folder (default: next to the model's, kept with it)"
    )
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    args.hf_cache = "dynamic"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("numba").setLevel(logging.WARNING)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cfg = make_config(args.layers, dtype, args.shape)
    k = cfg.num_experts_per_tok
    size = torch.tensor([], dtype=dtype).element_size()
    kv_tok = 2 * args.layers * cfg.num_key_value_heads * cfg.head_dim * size
    result: dict[str, Any] = {
        "benchmark": "moe_decode",
        "model": f"{args.shape} shape",
        "layers": args.layers,
        "full_layers": FULL_LAYERS,
        "device": device,
        "dtype": dtype_name(dtype),
        "env": env_info(device),
        "args": dict(vars(args)),
        "errors": {},
    }
    bw = measure_copy_bandwidth(device, args.bandwidth_bytes)
    result["copy_bandwidth"] = bw
    bw_Bps = bw["bandwidth_GBps"] * 1e9
    b1 = bytes_read(cfg, dtype, args.layers, k)
    full = bytes_read(cfg, dtype, FULL_LAYERS, k)
    result["floor"] = {
        "bytes_per_token": b1,
        "ms_per_token": b1["total"] / bw_Bps * 1e3,
        "tok_s": bw_Bps / b1["total"],
        "full_model_bytes_per_token": full["total"],
        "full_model_tok_s": bw_Bps / full["total"],
    }

    tmp = None
    model_dir = Path(args.model_dir) if args.model_dir else None
    if model_dir is None:
        tmp = tempfile.mkdtemp(prefix="voltserve-moe-bench-")
        model_dir = Path(tmp)
    rng = np.random.default_rng(args.seed)
    prompts = [
        random_prompt(rng, args.prompt_len, cfg.vocab_size) for _ in range(args.warmup + args.runs)
    ]
    compare_prompt = prompts[args.warmup]
    quant_dir = None
    try:
        hf_model = None
        if (
            not checkpoint_matches(model_dir, args.layers, args.seed, args.shape)
            or not args.skip_transformers
        ):
            t0 = time.perf_counter()
            hf_model = build_hf_model(cfg, device, dtype, args.seed)
            result["hf_build_s"] = time.perf_counter() - t0
        if not checkpoint_matches(model_dir, args.layers, args.seed, args.shape):
            t0 = time.perf_counter()
            write_checkpoint(hf_model, cfg, model_dir, args.seed, args.shape)
            result["checkpoint_write_s"] = time.perf_counter() - t0
        if not args.skip_transformers:
            hf_prompts = [
                random_prompt(rng, args.prompt_len, cfg.vocab_size) for _ in range(args.hf_warmup)
            ]
            hf_prompts += [compare_prompt] + [
                random_prompt(rng, args.prompt_len, cfg.vocab_size) for _ in range(args.hf_runs - 1)
            ]
            try:
                result["transformers"] = hf_decode(hf_model, device, hf_prompts, args)
            except Exception as e:
                traceback.print_exc()
                result["errors"]["transformers"] = f"{type(e).__name__}: {e}"
        del hf_model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        fp16_bytes = lambda e: bytes_read(cfg, dtype, args.layers, e)  # noqa: E731
        _run_engine(
            args, result, model_dir, device, dtype, prompts, bw_Bps, kv_tok, cfg, fp16_bytes
        )
        if args.quantization == "awq":
            quant_dir = Path(
                args.quant_dir or f"{model_dir}-awq-g{args.group_size}-{args.int4_modules}"
            )
            gc.collect()  # the fp16 engine's memory, before the int4 engine sizes its KV cache
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
                result["cuda_allocated_before_int4_bytes"] = torch.cuda.memory_allocated()
            _run_int4(
                args, result, model_dir, quant_dir, device, dtype, prompts, bw_Bps, kv_tok, cfg
            )
    finally:
        if tmp and not args.keep_model:
            shutil.rmtree(tmp, ignore_errors=True)
            if quant_dir is not None and not args.quant_dir:
                shutil.rmtree(quant_dir, ignore_errors=True)
    write_json(args.out, result)
    _print(result)
    return (
        1
        if {"engine", "int4_engine", "int4_checkpoint", "int4_floor"} & set(result["errors"])
        else 0
    )


def _run_int4(args, result, model_dir, quant_dir, device, dtype, prompts, bw_Bps, kv_tok, cfg):
    """The int4 checkpoint of model_dir (written, or reused when its marker matches and the
    fp16 one was not rewritten in this run) through the engine into result["int4"], with its
    floor and the ratios to the fp16 figures of this run."""
    from load_tests.make_awq_checkpoint import convert

    g, modules = args.group_size, args.int4_modules
    b1 = int4_bytes_read(cfg, dtype, args.layers, cfg.num_experts_per_tok, g, modules)
    full = int4_bytes_read(cfg, dtype, FULL_LAYERS, cfg.num_experts_per_tok, g, modules)
    fp = result["floor"]
    sub: dict[str, Any] = {
        "format": f"AWQ GEMM int4 g{g}",
        "modules": modules,
        "checkpoint_dir": str(quant_dir),
        "floor": {
            "bytes_per_token": b1,
            "ms_per_token": b1["total"] / bw_Bps * 1e3,
            "tok_s": bw_Bps / b1["total"],
            "full_model_bytes_per_token": full["total"],
            "full_model_tok_s": bw_Bps / full["total"],
            "full_model_speedup_vs_fp16": fp["full_model_bytes_per_token"] / full["total"],
        },
        "floor_speedup_vs_fp16": fp["bytes_per_token"]["total"] / b1["total"],
        "errors": {},
    }
    result["int4"] = sub
    try:
        if "checkpoint_write_s" in result:  # the fp16 weights changed: quantize them again
            (quant_dir / "voltserve_awq.json").unlink(missing_ok=True)
        sub["checkpoint"] = convert(model_dir, quant_dir, g, device, INT4_SKIP[modules])
    except Exception as e:
        traceback.print_exc()
        result["errors"]["int4_checkpoint"] = f"{type(e).__name__}: {e}"
        del sub["errors"]
        return
    int4_bytes = lambda e: int4_bytes_read(cfg, dtype, args.layers, e, g, modules)  # noqa: E731
    _run_engine(args, sub, quant_dir, device, dtype, prompts, bw_Bps, kv_tok, cfg, int4_bytes, b1)
    result["errors"].update({f"int4_{k}": v for k, v in sub.pop("errors").items()})
    e16, e4 = result.get("engine", {}), sub.get("engine", {})
    if e16.get("decode_tok_s") and e4.get("decode_tok_s"):
        sub["speedup_vs_fp16"] = e4["decode_tok_s"] / e16["decode_tok_s"]
        hf = result.get("transformers", {})
        if hf.get("decode_tok_s"):
            sub["speedup_vs_transformers_fp16"] = e4["decode_tok_s"] / hf["decode_tok_s"]
    fp16_batched = {r["batch_size"]: r for r in result.get("batched", [])}
    sub["batched_speedup_vs_fp16"] = {
        str(r["batch_size"]): r["output_tok_s"] / fp16_batched[r["batch_size"]]["output_tok_s"]
        for r in sub.get("batched", [])
        if r["batch_size"] in fp16_batched
    }


def _run_engine(
    args, result, model_dir, device, dtype, prompts, bw_Bps, kv_tok, cfg, weight_bytes, int4=None
) -> None:
    """The engine on model_dir: batch 1 (run_single), then each batch size, into `result`
    (the run's dict, or its "int4" part); weight_bytes(experts per layer) counts a step's
    weight bytes. int4: the int4 batch-1 bytes, checked against the loaded experts."""
    try:
        engine, init_s, ecfg = make_engine(model_dir, device, dtype, args)
    except Exception as e:
        traceback.print_exc()
        result["errors"]["engine"] = f"engine init: {type(e).__name__}: {e}"
        return
    result["engine_init_s"] = init_s
    result["kernel_impl"] = {
        op: engine.runner.ops.impl.get(op) for op in ("moe_experts", "moe_topk", "gemv")
    }
    result["cuda_graphs"] = engine.runner.graphs is not None
    from voltserve.kernels.moe.experts import wmma_enabled

    result["grouped_gemm"] = "wmma" if wmma_enabled() else "simt"
    if int4 is not None:
        loaded = loaded_expert_bytes(engine)
        result["loaded_expert_bytes"] = loaded
        if loaded != int4["expert_bytes"]:
            result["errors"]["floor"] = (
                f"the loaded experts hold {loaded} bytes each, the floor counts "
                f"{int4['expert_bytes']}"
            )
    ok = run_single(engine, prompts, args, result)
    if int4 is not None:
        result["fused_int4_decode_layers"] = fused_int4_decode_layers(
            engine, cfg.num_experts_per_tok
        )
    if not ok:
        return
    rng = np.random.default_rng(args.seed + 1)
    batched = []
    for b in args.batch_sizes:
        try:
            max_tokens = batched_max_tokens(b, args, engine.config.max_num_batched_tokens)
            r = engine_batched(
                engine,
                b,
                args.context,
                args.decode_steps,
                args.decode_warmup,
                max_tokens,
                cfg.vocab_size,
                rng,
            )
        except Exception as e:
            traceback.print_exc()
            result["errors"][f"batch_{b}"] = f"{type(e).__name__}: {e}"
            continue
        if r["steps_not_full_batch"]:
            result["errors"][f"batch_{b}"] = f"{r['steps_not_full_batch']} steps not full"
        wb = weight_bytes(distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, b))
        floor_ms = (wb["total"] + b * r["mean_context"] * kv_tok) / bw_Bps * 1e3
        r.update(
            batch_size=b,
            weight_bytes=wb,
            floor_ms=floor_ms,
            roofline_fraction=floor_ms / r["step_ms"],
            run_roofline_fraction=floor_ms / r["run_step_ms"],
            output_tok_s=b / (r["step_ms"] / 1e3),
            run_output_tok_s=b / (r["run_step_ms"] / 1e3),
        )
        r.pop("step_ms_all", None)
        batched.append(r)
    result["batched"] = batched


def _print(result: dict[str, Any]) -> None:
    f = result["floor"]
    e = result.get("engine", {})
    hf = result.get("transformers", {})
    print(
        f"moe decode ({result['layers']}/{result['full_layers']} layers, {result['dtype']}): "
        f"floor {f['tok_s']:.0f} tok/s; engine {e.get('decode_tok_s') or 0:.1f} tok/s "
        f"({e.get('roofline_fraction') or 0:.2f} of floor); transformers "
        f"{hf.get('decode_tok_s') or 0:.1f} tok/s ({hf.get('experts_implementation')}); "
        f"speedup {result.get('speedup_vs_transformers') or 0:.1f}x"
    )
    for r in result.get("batched", []):
        print(
            f"  batch {r['batch_size']}: {r['step_ms']:.2f} ms/step, {r['output_tok_s']:.0f} tok/s, "
            f"{r['roofline_fraction']:.2f} of floor ({r['floor_ms']:.2f} ms)"
        )
    q = result.get("int4")
    if q:
        e4 = q.get("engine", {})
        print(
            f"int4 {q['modules']} ({q['format']}): floor {q['floor']['tok_s']:.0f} tok/s "
            f"({q['floor_speedup_vs_fp16']:.2f}x the fp16 floor); engine "
            f"{e4.get('decode_tok_s') or 0:.1f} tok/s ({e4.get('roofline_fraction') or 0:.2f} of "
            f"floor), {q.get('speedup_vs_fp16') or 0:.2f}x fp16"
        )
        for r in q.get("batched", []):
            ratio = q["batched_speedup_vs_fp16"].get(str(r["batch_size"])) or 0
            print(
                f"  batch {r['batch_size']}: {r['step_ms']:.2f} ms/step, "
                f"{r['output_tok_s']:.0f} tok/s, {r['roofline_fraction']:.2f} of floor, "
                f"{ratio:.2f}x fp16"
            )
    if result["errors"]:
        print("errors:", result["errors"])


if __name__ == "__main__":
    sys.exit(main())
