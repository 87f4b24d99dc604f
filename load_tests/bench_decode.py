"""Decode speed of the engine on a random-weight checkpoint, against the HBM roofline of the same
card and against transformers `generate` on the same weights.

Single request (batch 1): a `--prompt-len` prompt, `--output-len` greedy tokens, ignore_eos; the
decode phase is the time from the first token to the last (prefill excluded). Median of `--runs`
warm runs. Its floor is the weight bytes one token reads (all layers + lm_head; the embedding
gather is left out) over the device copy bandwidth measured in the same run; `floor.
with_context_ms_per_token` adds the KV at the decode's mean context (only the full-attention
layers of a hybrid model hold KV) and a hybrid model's recurrent state, read and written once a
step (`roofline_fraction_with_context`).

Hybrid shapes at fewer layers (`--preset qwen3.5-27b --layers 16`: 12 Gated DeltaNet + 4 full
attention layers, the published 3:1 pattern, the same widths) fit a benchmark's disk and time;
the checkpoint and the floors follow the layer count.

Batched (`--batch-sizes 64,256 --context 1024`): B requests with `--context`-token prompts are
added at once and stepped until every one has finished its (chunked) prefill and produced its
first token; then only decode-only steps of the full batch are timed, twice: each step alone
(`step_ms`: the median wall time of engine.step() between device synchronizations, so the host's
share of a step adds to the GPU's), then `--decode-steps` more back to back as a server runs them
(`run_step_ms`: one synchronization at each end, so the pipelined decode overlaps the host's
share of a step with the GPU's previous one). max_tokens is high enough that no request ends
inside the timed windows (`steps_not_full_batch` must be 0, else the batch is an error). Their
floor adds the KV bytes read at that context to the weight bytes.

    python load_tests/bench_decode.py --preset llama3-8b --batch-sizes 64,256 --context 1024 \
        --out results/decode_llama3-8b.json
    python load_tests/bench_decode.py --preset tiny --device cpu --prompt-len 32 --output-len 8

A quantized --model-dir is served as it is (with --skip-transformers), its floor counted from
the bytes it stores: an AWQ / GPTQ folder (make_awq_checkpoint.py; --preset still names the
shape, for the KV bytes) or a GGUF file or the folder holding it (make_gguf_checkpoint.py, or any
GGUF: its metadata gives the shape and the vocabulary, whatever --preset says):
    python load_tests/bench_decode.py --preset llama3-8b --skip-transformers --runs 3 --warmup 1 \
        --model-dir /tmp/voltserve-llama3-8b-q4km/model.gguf
"""

from __future__ import annotations

import argparse
import gc
import logging
import shutil
import statistics
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
from voltserve.shared.config import KV_CACHE_DTYPES  # noqa: E402

from load_tests.common import (  # noqa: E402
    PRESETS,
    add_layers_argument,
    attention_layers,
    cell,
    checkpoint_matches,
    checkpoint_read_bytes,
    dtype_name,
    env_info,
    gguf_checkpoint_files,
    kv_bytes_per_element,
    kv_bytes_per_token,
    layer_overrides,
    make_hf_config,
    measure_copy_bandwidth,
    quantized_checkpoint,
    resolve_device,
    resolve_dtype,
    sequence_read_bytes,
    state_bytes_per_sequence,
    step_weight_bytes,
    synchronize,
    weight_bytes,
    write_json,
    write_random_checkpoint,
)

logger = logging.getLogger("bench_decode")


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    # Ids 0..15 are left out: small ids are often special tokens in real vocabularies.
    return rng.integers(16, vocab_size, size=length).tolist()


# ---------------------------------------------------------------------------------------------
# transformers


class _TimingStreamer:
    """transformers streamer that stamps each new token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.tokens: list[int] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        ids = value.reshape(-1).tolist()
        self.stamps.extend([now] * len(ids))
        self.tokens.extend(ids)

    def end(self) -> None:
        pass


def run_transformers(
    model_dir: Path, device: str, dtype: torch.dtype, prompts: list[list[int]], args
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    load_s = time.perf_counter() - t0
    gen_kw: dict[str, Any] = dict(
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,  # EOS cannot end it early: ignore_eos
        do_sample=False,
        pad_token_id=model.config.eos_token_id,
    )
    if args.hf_cache != "dynamic":
        gen_kw["cache_implementation"] = args.hf_cache
    runs = []
    first_tokens: list[int] = []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=device)
            streamer = _TimingStreamer()
            synchronize(device)
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer, **gen_kw)
            synchronize(device)
            n = len(streamer.tokens)
            if n != args.output_len:
                raise RuntimeError(f"transformers produced {n} tokens, expected {args.output_len}")
            decode_s = streamer.stamps[-1] - streamer.stamps[0]
            run = {
                "warmup": i < args.hf_warmup,
                "ttft_ms": (streamer.stamps[0] - start) * 1e3,
                "decode_s": decode_s,
                "decode_tok_s": (n - 1) / decode_s if decode_s > 0 else None,
                "ms_per_token": decode_s / (n - 1) * 1e3 if n > 1 else None,
            }
            runs.append(run)
            if i == args.hf_warmup:
                first_tokens = streamer.tokens
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "load_s": load_s,
        "cache_implementation": args.hf_cache,
        "runs": runs,
        "first_measured_tokens": first_tokens,
        **_summarise(runs),
    }


# ---------------------------------------------------------------------------------------------
# engine


def make_engine(model_dir: Path, device: str, dtype: torch.dtype, args):
    from voltserve.services.executor.engine import LLMEngine
    from voltserve.services.executor.engine_args import engine_config

    budget = max(args.max_num_batched_tokens, args.prompt_len, args.context)
    batched = [batched_max_tokens(b, args, budget) for b in args.batch_sizes]
    longest = max([args.prompt_len + args.output_len, *(args.context + m for m in batched)])
    max_batch = max([1, *args.batch_sizes])
    config = engine_config(
        model=str(model_dir),
        dtype=dtype_name(dtype),
        device=device,
        # --max-model-len: a server's bound (the decode graphs' attention grid follows it);
        # by default the shortest bound that holds the run.
        max_model_len=max(longest + 16, getattr(args, "max_model_len", None) or 0),
        max_num_seqs=max(max_batch, 8),
        max_num_batched_tokens=budget,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        max_graph_batch_size=max(max_batch, 1),
        # Only the sizes measured (and 1): the steps timed are pure decode steps of exactly
        # these batch sizes, so the other sizes' captures (~3 s each at 8B) would only cost time.
        cuda_graph_sizes=tuple(sorted({1, *args.batch_sizes})),
        seed=0,
        # Callers with their own flags (bench_moe, bench_spec) may not have -tp.
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    return engine, time.perf_counter() - t0, config


def engine_single(engine, rid: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    from voltserve.shared.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    stamps: list[float] = []
    tokens: list[int] = []
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id == rid:
                stamps.extend([now] * len(o.new_token_ids))
                tokens.extend(o.new_token_ids)
    if len(tokens) != output_len:
        raise RuntimeError(f"engine produced {len(tokens)} tokens, expected {output_len}")
    decode_s = stamps[-1] - stamps[0]
    n = len(tokens)
    return {
        "ttft_ms": (stamps[0] - start) * 1e3,
        "decode_s": decode_s,
        "decode_tok_s": (n - 1) / decode_s if decode_s > 0 else None,
        "ms_per_token": decode_s / (n - 1) * 1e3 if n > 1 else None,
        "tokens": tokens,
    }


def run_single(engine, prompts, args, result: dict) -> bool:
    """The engine's single-request decode runs into result["engine"] (with the roofline
    fraction and the comparison to transformers when it ran); False, with the error recorded,
    when they failed."""
    try:
        runs = []
        for i, prompt in enumerate(prompts):
            r = engine_single(engine, f"single-{i}", prompt, args.output_len)
            r["warmup"] = i < args.warmup
            runs.append(r)
        first_tokens = runs[args.warmup].pop("tokens")
        for r in runs:
            r.pop("tokens", None)
        single = {"runs": runs, **_summarise(runs)}
        if single["ms_per_token"]:
            fl = result["floor"]
            single["roofline_fraction"] = fl["ms_per_token"] / single["ms_per_token"]
            if "with_context_ms_per_token" in fl:  # (callers with floors of their own: bench_moe)
                single["roofline_fraction_with_context"] = (
                    fl["with_context_ms_per_token"] / single["ms_per_token"]
                )
        result["engine"] = single
        hf = result.get("transformers")
        if hf and hf.get("decode_tok_s") and single["decode_tok_s"]:
            result["speedup_vs_transformers"] = single["decode_tok_s"] / hf["decode_tok_s"]
            # Greedy on the same weights and prompt: how long the two agree (fp16 near-ties can
            # split them eventually; an early split points at a numerics bug).
            result["greedy_agreement_tokens"] = agree_prefix(
                first_tokens, hf.pop("first_measured_tokens")
            )
    except Exception as e:
        traceback.print_exc()
        result["errors"]["engine"] = f"single request: {type(e).__name__}: {e}"
        return False
    return True


def batched_max_tokens(batch: int, args: argparse.Namespace, budget: int) -> int:
    """Output budget of each batched request: tokens produced while the rest of the batch is still
    prefilling (one per step at most; a step prefills at least budget - batch tokens), plus the
    warmup and timed steps, plus slack, so that no request finishes inside the timed window."""
    if budget <= batch:
        raise ValueError(f"max_num_batched_tokens {budget} must exceed the batch size {batch}")
    prefill_steps = -(-batch * args.context // (budget - batch)) + 1
    return prefill_steps + args.decode_warmup + 2 * args.decode_steps + 4


def engine_batched(
    engine, batch: int, context: int, steps: int, warm: int, max_tokens: int, vocab: int, rng
) -> dict[str, Any]:
    """Prefill `batch` requests of `context` tokens; once every one of them decodes, time
    `steps` decode-only steps of the full batch (after `warm` untimed ones)."""
    from voltserve.shared.sampling_params import SamplingParams

    cfg = engine.config
    device = cfg.device
    if cfg.max_num_seqs < batch:
        raise ValueError(f"batch {batch} exceeds max_num_seqs {cfg.max_num_seqs}")
    bm = engine.block_manager
    bs = engine.block_size
    need_blocks = batch * -(-(context + max_tokens) // bs)
    if bm.num_blocks < need_blocks:
        raise ValueError(
            f"the KV cache holds {bm.num_blocks} blocks of {bs} tokens; batch {batch} x "
            f"(context {context} + up to {max_tokens} output tokens) needs {need_blocks}: "
            "lower the batch size or context, or raise --gpu-memory-utilization"
        )
    if bm.num_free_blocks != bm.num_blocks or engine.has_unfinished_requests():
        raise RuntimeError("the engine is not idle before the batched run")

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, random_prompt(rng, context, vocab), params)
    # Step until every request has finished its prefill and produced its first token: from
    # then on each step is a decode-only step of the whole batch.
    n_out: dict[str, int] = {}
    t0 = time.perf_counter()
    prefill_steps = 0
    while len(n_out) < batch:
        for o in engine.step():
            if o.new_token_ids:
                n_out[o.request_id] = n_out.get(o.request_id, 0) + len(o.new_token_ids)
            if o.finish_reason is not None:
                raise RuntimeError(f"{o.request_id} finished ({o.finish_reason}) while prefilling")
        prefill_steps += 1
        if prefill_steps > 100_000:
            raise RuntimeError("prefill of the batch does not finish")
    synchronize(device)
    prefill_s = time.perf_counter() - t0
    if max(n_out.values()) + warm + 2 * steps >= max_tokens:
        raise RuntimeError(
            f"prefill took {prefill_steps} steps: max_tokens {max_tokens} would end requests "
            "inside the timed windows"
        )

    def full(outs) -> bool:
        """One new token for every request and none finished: a clean decode step of the batch
        (otherwise a preemption or a finished request)."""
        return len(outs) == batch and all(
            len(o.new_token_ids) == 1 and o.finish_reason is None for o in outs
        )

    step_s: list[float] = []
    short_steps = 0
    for k in range(warm + steps):
        synchronize(device)
        t = time.perf_counter()
        outs = engine.step()
        synchronize(device)
        dt = time.perf_counter() - t
        if k >= warm:
            step_s.append(dt)
            short_steps += not full(outs)
    # The same steps back to back, as a server runs them: no synchronization between steps.
    pipeline = getattr(engine.runner, "pipeline", None)
    used0 = pipeline.used if pipeline is not None else 0
    synchronize(device)
    t = time.perf_counter()
    for _ in range(steps):
        short_steps += not full(engine.step())
    synchronize(device)
    run_s = (time.perf_counter() - t) / steps
    # Steps of the back-to-back run that used a step launched ahead (decode_pipeline.py): all
    # but the first when the pipeline overlaps the host's share of each step with the GPU's.
    run_pipelined = pipeline.used - used0 if pipeline is not None else 0
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "prefill_s": prefill_s,
        "prefill_steps": prefill_steps,
        "max_tokens": max_tokens,
        "step_ms_all": [s * 1e3 for s in step_s],
        "step_ms": statistics.median(step_s) * 1e3,
        "steps_not_full_batch": short_steps,
        "run_step_ms": run_s * 1e3,
        "run_steps_pipelined": run_pipelined,
        # KV tokens a timed step reads per request, averaged over requests and timed steps
        # (requests that finished their prefill early hold more output tokens).
        "mean_context": context + statistics.mean(n_out.values()) + warm + (steps - 1) / 2,
    }


def _summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    measured = [r for r in runs if not r["warmup"]]
    out: dict[str, Any] = {"num_measured_runs": len(measured)}
    for key in ("decode_tok_s", "ms_per_token", "ttft_ms"):
        vals = [r[key] for r in measured if r[key] is not None]
        out[key] = statistics.median(vals) if vals else None
    return out


def agree_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    add_layers_argument(p)
    p.add_argument(
        "--model-dir",
        help="reuse (or write once into) this checkpoint folder; a quantized folder or a GGUF "
        "file (or its folder) is served as it is",
    )
    p.add_argument("--keep-model", action="store_true", help="keep the temporary checkpoint")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: float16 on CUDA, float32 on CPU")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--runs", type=int, default=5, help="measured engine runs (median)")
    p.add_argument("--warmup", type=int, default=2, help="engine warmup runs")
    p.add_argument("--hf-runs", type=int, default=3, help="measured transformers runs")
    p.add_argument("--hf-warmup", type=int, default=1)
    p.add_argument("--hf-cache", default="dynamic", choices=["dynamic", "static"])
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--batch-sizes", default="", help="e.g. 64,256: also time batched decode")
    p.add_argument("--context", type=int, default=1024, help="prompt length of batched mode")
    p.add_argument("--decode-steps", type=int, default=32, help="timed steps per batch size")
    p.add_argument("--decode-warmup", type=int, default=4)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="engine step token budget (raised to the longest prompt)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's bound (e.g. 8192, a server's): decode graphs size attention by it",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the KV cache's storage (voltserve serve's flag); the floors count its bytes",
    )
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs of one engine (load_tests/bench_tp.py sets the floor for it)",
    )
    p.add_argument("--bandwidth-bytes", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("numba").setLevel(logging.WARNING)  # a line per CUDA module unload
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    overrides = layer_overrides(args.layers)
    config = make_hf_config(args.preset, dtype, **overrides)
    # A quantized folder (--model-dir of an AWQ / GPTQ checkpoint) is served as it is, and its
    # floor counts the bytes it stores: packed codes, scales, zero points, fp16 lm_head. So is
    # a GGUF file (or a folder holding one: make_gguf_checkpoint.py's Q4_K_M), its floor the
    # bytes of its tensor table: Q4_K / Q6_K blocks, F32 norms, the Q6_K output head. The
    # engine is fed token ids, so no tokenizer is needed.
    quantized = bool(args.model_dir) and quantized_checkpoint(Path(args.model_dir))
    if quantized and not args.skip_transformers:
        raise SystemExit("a quantized --model-dir needs --skip-transformers")
    gguf = quantized and gguf_checkpoint_files(Path(args.model_dir)) is not None
    if gguf:
        from load_tests.common import gguf_config

        config = gguf_config(Path(args.model_dir))
    wbytes = (
        checkpoint_read_bytes(Path(args.model_dir)) if quantized else weight_bytes(config, dtype)
    )
    # K and V elements a token (one byte each as uint8) times the cache's bytes an element
    kv_tok = kv_bytes_per_token(config, torch.uint8) * kv_bytes_per_element(
        args.kv_cache_dtype, dtype
    )
    state_seq = state_bytes_per_sequence(config, dtype)
    result: dict[str, Any] = {
        "benchmark": "decode",
        "preset": args.preset,
        "device": device,
        "dtype": dtype_name(dtype),
        "env": env_info(device),
        "args": {k: v for k, v in vars(args).items()},
        "model": {
            **wbytes,
            "kv_bytes_per_token": kv_tok,
            "state_bytes_per_sequence": state_seq,
            "layers": config.num_hidden_layers,
            "kv_layers": attention_layers(config),
            "vocab_size": config.vocab_size,
            "quantized": quantized,
            "format": "gguf" if gguf else "safetensors",
        },
        "errors": {},
    }

    logger.info("measuring copy bandwidth on %s", device)
    bw = measure_copy_bandwidth(device, args.bandwidth_bytes)
    result["copy_bandwidth"] = bw
    bw_Bps = bw["bandwidth_GBps"] * 1e9
    floor_s = wbytes["read_per_token_bytes"] / bw_Bps
    result["floor"] = {
        "weight_read_bytes": wbytes["read_per_token_bytes"],
        "ms_per_token": floor_s * 1e3,
        "tok_s": 1.0 / floor_s,
    }
    # The single request's floor with its KV (at the mean context of its decode) and its
    # recurrent state (read and written once a step) added to the weights: what a long prompt
    # or a hybrid model reads besides the weights.
    mean_context = args.prompt_len + args.output_len / 2
    seq_bytes = sequence_read_bytes(mean_context, kv_tok, state_seq)
    ctx_s = (wbytes["read_per_token_bytes"] + seq_bytes) / bw_Bps
    result["floor"].update(
        mean_context=mean_context,
        kv_read_bytes=mean_context * kv_tok,
        state_read_write_bytes=2 * state_seq,
        with_context_ms_per_token=ctx_s * 1e3,
    )

    tmp = None
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        tmp = tempfile.mkdtemp(prefix=f"voltserve-{args.preset}-")
        model_dir = Path(tmp)
    try:
        if not quantized and not checkpoint_matches(model_dir, args.preset, overrides):
            t0 = time.perf_counter()
            logger.info("writing a random %s checkpoint to %s", args.preset, model_dir)
            write_random_checkpoint(
                model_dir, args.preset, device, dtype, seed=args.seed, overrides=overrides
            )
            result["checkpoint_write_s"] = time.perf_counter() - t0
        result["model_dir"] = str(model_dir)
        _run_all(args, result, model_dir, device, dtype, bw_Bps, kv_tok, wbytes, state_seq)
    finally:
        if tmp and not args.keep_model:
            shutil.rmtree(tmp, ignore_errors=True)

    write_json(args.out, result)
    print_table(result)
    failed = [k for k in result["errors"] if k == "engine" or k.startswith("batch_")]
    return 1 if failed else 0


def _run_all(args, result, model_dir, device, dtype, bw_Bps, kv_tok, wbytes, state_seq=0) -> None:
    rng = np.random.default_rng(args.seed)
    vocab = result["model"]["vocab_size"]
    n_engine = args.warmup + args.runs
    prompts = [random_prompt(rng, args.prompt_len, vocab) for _ in range(n_engine)]
    compare_prompt = prompts[args.warmup]  # the first measured engine prompt

    # transformers first: its memory is freed before the engine sizes its KV cache.
    if not args.skip_transformers:
        logger.info("transformers generate (%d runs)", args.hf_warmup + args.hf_runs)
        hf_prompts = [random_prompt(rng, args.prompt_len, vocab) for _ in range(args.hf_warmup)]
        hf_prompts += [compare_prompt] + [
            random_prompt(rng, args.prompt_len, vocab) for _ in range(args.hf_runs - 1)
        ]
        try:
            result["transformers"] = run_transformers(model_dir, device, dtype, hf_prompts, args)
        except Exception as e:  # keep going: the engine numbers still count
            traceback.print_exc()
            result["errors"]["transformers"] = f"{type(e).__name__}: {e}"

    try:
        engine, init_s, cfg = make_engine(model_dir, device, dtype, args)
    except Exception as e:
        traceback.print_exc()
        result["errors"]["engine"] = f"engine init: {type(e).__name__}: {e}"
        return
    result["engine_init_s"] = init_s
    result["engine_config"] = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    logger.info("engine single-request decode (%d runs)", n_engine)
    if not run_single(engine, prompts, args, result):
        return

    def floor_at(batch: int, mean_context: float) -> float:
        """ms to read the weights, `batch` sequences' KV at that mean context and their
        recurrent state (read and written)."""
        seq = sequence_read_bytes(mean_context, kv_tok, state_seq)
        return (step_weight_bytes(wbytes, batch) + batch * seq) / bw_Bps * 1e3

    batched = []
    for b in args.batch_sizes:
        logger.info("engine batched decode: batch %d, context %d", b, args.context)
        try:
            max_tokens = batched_max_tokens(b, args, engine.config.max_num_batched_tokens)
            r = engine_batched(
                engine,
                b,
                args.context,
                args.decode_steps,
                args.decode_warmup,
                max_tokens,
                vocab,
                rng,
            )
        except Exception as e:
            traceback.print_exc()
            result["errors"][f"batch_{b}"] = f"{type(e).__name__}: {e}"
            continue
        if r["steps_not_full_batch"]:
            # Every timed step must be a decode step of the whole batch, or the number is wrong.
            result["errors"][f"batch_{b}"] = (
                f"{r['steps_not_full_batch']} of {args.decode_steps} timed steps were not "
                f"decode-only steps of the full batch"
            )
        kv = b * r["mean_context"] * kv_tok
        floor_ms = floor_at(b, r["mean_context"])
        r.update(
            batch_size=b,
            context=args.context,
            kv_read_bytes=kv,
            floor_ms=floor_ms,
            ratio_to_floor=r["step_ms"] / floor_ms,
            roofline_fraction=floor_ms / r["step_ms"],
            output_tok_s=b / (r["step_ms"] / 1e3),
        )
        # The back-to-back steps come after the timed ones: each sequence is `steps` longer.
        run_floor_ms = floor_at(b, r["mean_context"] + args.decode_steps)
        r.update(
            run_floor_ms=run_floor_ms,
            run_ratio_to_floor=r["run_step_ms"] / run_floor_ms,
            run_output_tok_s=b / (r["run_step_ms"] / 1e3),
        )
        batched.append(r)
    if args.batch_sizes:
        result["batched"] = batched
        if len(batched) < len(args.batch_sizes):
            result["errors"]["engine"] = "batched decode failed for some batch sizes"


def print_table(result: dict[str, Any]) -> None:
    bw = result.get("copy_bandwidth", {})
    fl = result.get("floor", {})
    print()
    print(
        f"decode benchmark: {result['preset']} {result['dtype']} on {result['env'].get('device_name')}"
    )
    print(
        f"copy bandwidth {cell(bw.get('bandwidth_GBps'), '.0f')} GB/s; "
        f"weight floor {cell(fl.get('ms_per_token'), '.3f')} ms/token "
        f"({cell(fl.get('tok_s'), '.1f')} tok/s); with the KV at a mean context of "
        f"{cell(fl.get('mean_context'), '.0f')} and the recurrent state "
        f"{cell(fl.get('with_context_ms_per_token'), '.3f')} ms/token"
    )
    print(f"{'':<14}{'tok/s':>10}{'ms/token':>10}{'TTFT ms':>10}{'of floor':>10}")
    for name in ("engine", "transformers"):
        r = result.get(name)
        if r:
            frac = r.get("roofline_fraction")
            if frac is None and r.get("ms_per_token") and fl.get("ms_per_token"):
                frac = fl["ms_per_token"] / r["ms_per_token"]
            print(
                f"{name:<14}{cell(r.get('decode_tok_s'), '.1f'):>10}"
                f"{cell(r.get('ms_per_token'), '.3f'):>10}{cell(r.get('ttft_ms'), '.1f'):>10}"
                f"{cell(frac, '.1%'):>10}"
            )
    if result.get("speedup_vs_transformers"):
        print(
            f"engine / transformers: {result['speedup_vs_transformers']:.2f}x; greedy agreement "
            f"{result.get('greedy_agreement_tokens')} tokens"
        )
    if result.get("batched"):
        print(
            f"{'batch':>6}{'context':>9}{'step ms':>10}{'floor ms':>10}{'ratio':>8}{'tok/s':>10}"
            f"{'run ms':>9}{'ratio':>7}{'piped':>7}"
        )
        for r in result["batched"]:
            print(
                f"{r['batch_size']:>6}{r['context']:>9}{r['step_ms']:>10.3f}"
                f"{r['floor_ms']:>10.3f}{r['ratio_to_floor']:>8.2f}{r['output_tok_s']:>10.0f}"
                f"{r['run_step_ms']:>9.3f}{r['run_ratio_to_floor']:>7.2f}"
                f"{r['run_steps_pipelined']:>7}"
            )
    for k, v in result["errors"].items():
        print(f"ERROR {k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
