"""Long-context decode and prefill on a Llama-3.1-8B-shaped random-weight checkpoint: batch-1
decode speed at contexts up to 262,144 tokens with the KV cache in fp16 and in one byte (fp8),
fp16 and AWQ int4 weights, each point against its bytes floor; the time to first token of a
long prompt and the memory its chunked prefill takes; and (--fit) the longest context an
executor under a --max-gpu-memory budget holds, served with one real request of that length.

The checkpoint: the llama3-8b preset with Llama 3.1's rope scaling (llama3: factor 8 over 8,192
original positions, low / high frequency factors 1 / 4) and max_position_embeddings written as
262,144 instead of Llama 3.1's 131,072 (the rope tables are the same functions of the position;
`--rope yarn` writes YaRN instead, factor 32 over 8,192 original positions, as long-context
Qwen configs do). Random weights, written once on the device (common.write_random_checkpoint);
the AWQ int4 g128 folder is quantized from it (make_awq_checkpoint.py). Speed does not depend
on the values.

Decode: one engine per (weights, --kv-cache-dtype), each in a process of its own (a clean
allocator and peak-memory counters; a run past the time budget is stopped without losing the
points already written). Its bound (--max-model-len, which sizes the decode graphs' attention
grid as a server's would) is the longest context asked for plus --output-len, at most the
model's 262,144. All contexts are prefixes of one random token sequence, and prefix caching is
on: the --ttft-context prompt is prefilled first from nothing (its time to first token and the
prefill's peak memory are the figures reported), the shorter contexts then reuse its cached
blocks, and a longer one computes only the tokens past the longest prefix already cached (its
prefill time covers those tokens only: `prefill_tokens_computed`). Every prefill goes through
the engine in chunks of --max-num-batched-tokens. Each point then decodes --output-len greedy
tokens (ignore_eos, batch 1, the decode graph of size 1); tok/s is (n - 1) / (last - first
token time). Its floor: the weight bytes a token reads (all layers and the lm_head; an AWQ
folder's stored bytes) plus the KV bytes at the decode's mean context (2 bytes an element in
fp16, 1 in fp8), over the device copy bandwidth measured in the same run (common.py).

A hybrid model (`--preset qwen3.5-27b --layers 16 --rope native`: Gated DeltaNet layers with a
full-attention layer every fourth, its own rope to 262,144 positions) keeps KV in its
full-attention layers only, so its floor adds the recurrent state read and written each step to
the weights and that KV; `longest_over_shortest` is each run's speed at its longest context over
its shortest (the reference system's 128K / 4K). Prefix caching is off for hybrid models, so
each of their contexts is prefilled from nothing.

Peak memory of the fresh prefill: torch.cuda.max_memory_allocated over the request (from its
arrival to its first token), and above what was allocated before it (weights, the KV pool, the
decode graph's pool): the activation share, next to the activation peak the engine's KV sizing
measured at start (its log line, captured).

    python load_tests/bench_long_context.py --out results/long_context.json
    python load_tests/bench_long_context.py --weights awq --kv auto,fp8_e5m2 \
        --contexts 4096,32768,131072 --time-budget 420 --out results/long_context_awq.json
    python load_tests/bench_long_context.py --fit 16GiB,32GiB --weights awq --kv fp8_e5m2 \
        --out results/long_context_fit.json
    python load_tests/bench_long_context.py --preset tiny --device cpu --rope llama3 \
        --contexts 64,256 --ttft-context 256 --output-len 8 --in-process
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
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
    cell,
    checkpoint_matches,
    checkpoint_read_bytes,
    env_info,
    kv_bytes_per_element,
    kv_bytes_per_token,
    layer_overrides,
    make_hf_config,
    measure_copy_bandwidth,
    resolve_device,
    sequence_read_bytes,
    state_bytes_per_sequence,
    synchronize,
    weight_bytes,
    write_json,
    write_random_checkpoint,
)

logger = logging.getLogger("bench_long_context")

WEIGHTS = ("fp16", "awq")
# Llama 3.1's pretraining context, which both rope settings scale from.
ORIGINAL_POSITIONS = 8192
LONGEST = 262144


def rope_overrides(preset: str, rope: str, max_positions: int) -> dict[str, Any]:
    """Config fields that give `preset` a rope scaling reaching max_positions (see the module
    docstring): llama3 as Llama 3.1 with max_position_embeddings raised, or YaRN by
    max_positions / ORIGINAL_POSITIONS; native: the preset's own rope (a model trained to its
    max_position_embeddings, as Qwen3.5's 262,144), only the length written when it differs."""
    if rope == "native":
        native = PRESETS[preset].get("max_position_embeddings")
        return {} if native == max_positions else {"max_position_embeddings": max_positions}
    theta = PRESETS[preset]["rope_theta"]
    original = min(ORIGINAL_POSITIONS, max_positions // 2)  # (small --max-positions: tests)
    if rope == "llama3":
        params = {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": original,
        }
    elif rope == "yarn":
        params = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": max_positions / original,
            "original_max_position_embeddings": original,
        }
    else:
        raise ValueError(f"unknown rope {rope!r} (llama3, yarn or native)")
    return {"max_position_embeddings": max_positions, "rope_parameters": params}


def checkpoint_overrides(args) -> dict[str, Any]:
    """The checkpoint's config overrides: the rope's (rope_overrides) and --layers'."""
    rope = rope_overrides(args.preset, args.rope, args.max_positions)
    return rope | layer_overrides(args.layers)


def random_tokens(seed: int, n: int, vocab: int) -> list[int]:
    # Ids 0..15 are left out: small ids are often special tokens in real vocabularies.
    return np.random.default_rng(seed).integers(16, vocab, size=n).tolist()


def prompt_lengths(contexts: list[int], bound: int, output_len: int) -> dict[int, int]:
    """Each context's prompt: the context itself, or less where its output would pass the
    bound (the 262,144 point under a 262,144-token model: 262,144 - output_len)."""
    return {c: min(c, bound - output_len) for c in contexts}


def measure_order(contexts: list[int], ttft_context: int | None) -> list[int]:
    """The fresh prefill first (nothing cached yet), then the rest shortest first, so that each
    longer prompt reuses the longest prefix already cached."""
    rest = sorted(c for c in contexts if c != ttft_context)
    return ([ttft_context] if ttft_context in contexts else []) + rest


# ---------------------------------------------------------------------------------------------
# Worker: one engine, every context (run in its own process unless --in-process)


class SizingLog(logging.Handler):
    """Keeps the numbers of the KV sizing's "memory: ..." log line (kv_sizing.py) in GiB."""

    FIELDS = ("total", "card", "weights", "activation_peak", "graph_logits", "other", "kv_budget")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.values: dict[str, float] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("memory: total") and record.args:
            self.values = {k: float(v) for k, v in zip(self.FIELDS, record.args)}


def decode_launch(runner, bound: int, kv: str) -> dict[str, Any] | None:
    """The batch-1 decode attention launch the decode graph holds under this bound (CUDA):
    partition, partitions, core, threads, and the fp32 merge workspace it allocates."""
    if runner.device.type != "cuda":
        return None
    from voltserve.kernels.attention import decode, kv_widen
    from voltserve.services.executor.kv_quant import _FP8

    fmt = _FP8.get(kv, kv_widen.FP16)
    a = runner.arch
    sms = decode.sm_count(runner.device)
    cfg, n_part = decode.launch_with_threads(
        a.num_heads, runner.num_kv_heads, a.head_dim, 1, bound, sms, None, None, None, None, fmt
    )
    mode = (
        "direct" if n_part == 1 else ("merge" if n_part <= decode.MERGE_MAX_PARTITIONS else "split")
    )
    p_ws = {"direct": 1, "split": n_part, "merge": decode.MERGE_MAX_PARTITIONS}[mode]
    return {
        "bound": bound,
        "sms": sms,
        "partition": cfg.partition,
        "partitions": n_part,
        "heads_per_block": cfg.group,
        "online_core": cfg.online,
        "threads": cfg.num_threads,
        "mode": mode,
        "grid_blocks": n_part * runner.num_kv_heads * cfg.split,
        "workspace_bytes": a.num_heads * p_ws * (a.head_dim + 2) * 4,
    }


def one_request(engine, rid: str, prompt: list[int], output_len: int, device: str) -> dict:
    """Serve one greedy request alone; times of its first and last token, and the peak memory
    from its arrival to its first token (its prefill) above what was allocated before it."""
    from voltserve.shared.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    cuda = device.startswith("cuda")
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    stamps: list[float] = []
    prefill_peak = None
    cached = 0
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id == rid and o.new_token_ids:
                if not stamps:
                    cached = o.num_cached_tokens
                    if cuda:
                        prefill_peak = torch.cuda.max_memory_allocated()
                stamps.extend([now] * len(o.new_token_ids))
    if len(stamps) != output_len:
        raise RuntimeError(f"{rid}: {len(stamps)} tokens, expected {output_len}")
    n = len(stamps)
    decode_s = stamps[-1] - stamps[0]
    out: dict[str, Any] = {
        "cached_prompt_tokens": cached,
        "prefill_tokens_computed": len(prompt) - cached,
        "ttft_s": stamps[0] - start,
        "decode_s": decode_s,
        "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
        "ms_per_token": decode_s / (n - 1) * 1e3 if n > 1 else None,
    }
    if cuda:
        out["allocated_before_bytes"] = before
        out["prefill_peak_bytes"] = prefill_peak
        out["prefill_activation_bytes"] = prefill_peak - before
    return out


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine (spec: model, kv, device, bound, contexts...), every context in turn; the
    result is written to spec["out"] after each point, so a stopped worker keeps its points."""
    from voltserve.services.executor import kv_sizing
    from voltserve.services.executor.engine import LLMEngine
    from voltserve.services.executor.engine_args import engine_config

    result: dict[str, Any] = {"points": [], "errors": {}}
    sizing = SizingLog()
    logging.getLogger(kv_sizing.__name__).addHandler(sizing)
    device = spec["device"]

    def save() -> None:
        result["sizing_log_gib"] = sizing.values
        write_json(spec["out"], result)

    config = engine_config(
        model=spec["model"],
        dtype=spec["dtype"],
        device=device,
        max_model_len=spec["bound"],
        max_num_seqs=1,
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        gpu_memory_utilization=spec["gpu_memory_utilization"],
        max_graph_batch_size=1,
        cuda_graph_sizes=(1,),
        kv_cache_dtype=spec["kv"],
        # None: the engine's default, off for a hybrid model (its recurrent state has no
        # snapshots at block boundaries), where every context is prefilled from nothing
        enable_prefix_caching=spec.get("prefix_caching", True),
        seed=0,
    )
    t0 = time.perf_counter()
    try:
        engine = LLMEngine(config)
    except Exception as e:
        traceback.print_exc()
        result["errors"]["engine"] = f"engine init: {type(e).__name__}: {e}"
        save()
        return result
    runner = engine.runner
    result["engine_init_s"] = time.perf_counter() - t0
    result["max_model_len"] = engine.max_model_len
    result["num_kv_blocks"] = runner.num_kv_blocks
    result["kv_pool_bytes"] = runner.num_kv_blocks * kv_sizing.kv_bytes_per_block(runner)
    result["kv_capacity_tokens"] = runner.num_kv_blocks * runner.block_size
    result["decode_graphs"] = runner.graphs is not None
    result["decode_launch"] = decode_launch(runner, engine.max_model_len, spec["kv"])
    save()

    tokens = random_tokens(spec["seed"], max(spec["prompts"].values()), runner.vocab_size)
    warm = random_tokens(spec["seed"] + 1, spec["warmup_len"], runner.vocab_size)
    try:
        one_request(engine, "warmup", warm, 8, device)
    except Exception as e:
        traceback.print_exc()
        result["errors"]["warmup"] = f"{type(e).__name__}: {e}"
        save()
        return result
    for c in measure_order(spec["contexts"], spec["ttft_context"]):
        n = spec["prompts"][str(c)]
        logger.info("context %d: prompt %d tokens", c, n)
        point: dict[str, Any] = {"context": c, "prompt_len": n, "output_len": spec["output_len"]}
        try:
            point.update(one_request(engine, f"ctx-{c}", tokens[:n], spec["output_len"], device))
        except Exception as e:
            traceback.print_exc()
            result["errors"][f"context_{c}"] = f"{type(e).__name__}: {e}"
            save()
            continue
        point["fresh"] = point["cached_prompt_tokens"] == 0
        point["prefill_tok_s"] = point["prefill_tokens_computed"] / point["ttft_s"]
        # KV tokens the timed decode steps read, on average over the n - 1 timed tokens.
        point["mean_context"] = n + spec["output_len"] / 2
        result["points"].append(point)
        save()
    return result


# ---------------------------------------------------------------------------------------------
# Parent: checkpoints, bandwidth, one worker per (weights, kv), floors and ratios


def ensure_checkpoints(args, device: str, result: dict[str, Any]) -> dict[str, Path]:
    """The fp16 folder (written once, reused when its marker matches) and, when asked for, its
    AWQ int4 g128 copy beside it."""
    overrides = checkpoint_overrides(args)
    fp16_dir = Path(args.model_dir)
    dirs: dict[str, Path] = {"fp16": fp16_dir}
    if not checkpoint_matches(fp16_dir, args.preset, overrides):
        t0 = time.perf_counter()
        logger.info("writing a random %s checkpoint to %s", args.preset, fp16_dir)
        write_random_checkpoint(
            fp16_dir, args.preset, device, args.torch_dtype, args.seed, overrides=overrides
        )
        result["checkpoint_write_s"] = time.perf_counter() - t0
    if "awq" in args.weights or (args.fit and args.fit_weights == "awq"):
        from load_tests.make_awq_checkpoint import convert

        awq_dir = Path(args.awq_dir or f"{fp16_dir}-awq-g{args.awq_group}")
        result["awq_write"] = convert(fp16_dir, awq_dir, args.awq_group, device)
        dirs["awq"] = awq_dir
    return dirs


def release_cached_memory(device: str) -> None:
    """Give back what the checkpoint writes left in this process's allocator cache: the
    engines (other processes) size their KV caches from the card's free memory."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def weight_read_bytes(weights: str, model_dir: Path, config, dtype: torch.dtype) -> int:
    if weights == "awq":
        return checkpoint_read_bytes(model_dir)["read_per_token_bytes"]
    return weight_bytes(config, dtype)["read_per_token_bytes"]


def add_floors(
    run: dict[str, Any], w_bytes: int, kv_tok: int, bw_Bps: float, state_seq: int = 0
) -> None:
    """Each point's floor (weights + KV at its mean context + a hybrid model's recurrent state,
    read and written once a step, over the copy bandwidth) and the fraction of it the engine
    reached; the speed at the longest context over that at the shortest."""
    run["kv_bytes_per_token"] = kv_tok
    run["state_bytes_per_sequence"] = state_seq
    for p in run.get("points", []):
        read = w_bytes + sequence_read_bytes(p["mean_context"], kv_tok, state_seq)
        p["floor_read_bytes"] = read
        p["floor_ms"] = read / bw_Bps * 1e3
        p["floor_tok_s"] = 1e3 / p["floor_ms"]
        if p.get("ms_per_token"):
            p["fraction_of_floor"] = p["floor_ms"] / p["ms_per_token"]
    timed = sorted(
        (p["context"], p["decode_tok_s"]) for p in run.get("points", []) if p.get("decode_tok_s")
    )
    if len(timed) > 1:
        run["longest_over_shortest"] = {
            "contexts": [timed[-1][0], timed[0][0]],
            "speed_ratio": timed[-1][1] / timed[0][1],
        }


def kv_ratios(runs: list[dict[str, Any]], context: int) -> list[dict[str, Any]]:
    """Per weights, each one-byte KV run against the fp16 (auto) one at `context`: the speed
    ratio and the ratio of their floors (what the bytes alone predict)."""
    out = []
    by = {(r["weights"], r["kv"]): r for r in runs}
    for (weights, kv), r in by.items():
        base = by.get((weights, "auto")) or by.get((weights, "fp16"))
        if not kv.startswith("fp8") or base is None:
            continue
        p = next((x for x in r.get("points", []) if x["context"] == context), None)
        q = next((x for x in base.get("points", []) if x["context"] == context), None)
        if not p or not q or not p.get("decode_tok_s") or not q.get("decode_tok_s"):
            continue
        speed = p["decode_tok_s"] / q["decode_tok_s"]
        floors = q["floor_ms"] / p["floor_ms"]
        out.append(
            {
                "weights": weights,
                "kv": kv,
                "against": base["kv"],
                "context": context,
                "speed_ratio": speed,
                "floor_ratio": floors,
                "speed_over_floor_ratio": speed / floors,
            }
        )
    return out


def run_point(args, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """A worker for one (weights, kv): in this process (--in-process) or in a child process
    stopped after `timeout` seconds (what it wrote by then is kept)."""
    if args.in_process:
        return run_worker(spec)
    spec_path = Path(spec["out"]).with_suffix(".spec.json")
    write_json(spec_path, spec)
    log_path = Path(spec["out"]).with_suffix(".log")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)]
    timed_out = False
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
    res = json.loads(Path(spec["out"]).read_text()) if Path(spec["out"]).is_file() else {}
    res.setdefault("points", [])
    res.setdefault("errors", {})
    res["worker_log"] = str(log_path)
    if timed_out:
        res["errors"]["worker"] = f"stopped after {timeout:.0f} s (time budget)"
    elif rc != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        res["errors"]["worker"] = f"exit code {rc}; log tail:\n{tail}"
    return res


def main_bench(args, device: str, result: dict[str, Any], t_start: float) -> None:
    dirs = ensure_checkpoints(args, device, result)
    release_cached_memory(device)
    config = make_hf_config(args.preset, args.torch_dtype, **checkpoint_overrides(args))
    kv_elem_tok = kv_bytes_per_token(config, torch.uint8)  # K and V elements a token
    state_seq = state_bytes_per_sequence(config, args.torch_dtype)
    bw = result["copy_bandwidth"]["bandwidth_GBps"] * 1e9
    bound = min(args.max_positions, max(args.contexts) + args.output_len)
    if args.max_model_len:
        bound = args.max_model_len
    prompts = prompt_lengths(args.contexts, bound, args.output_len)
    result["bound"] = bound
    result["prompt_lens"] = {str(c): n for c, n in prompts.items()}
    runs: list[dict[str, Any]] = []
    result["runs"] = runs
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="voltserve-longctx-"))
    work.mkdir(parents=True, exist_ok=True)
    last_wall: dict[str, float] = {}
    for weights in args.weights:
        w_bytes = weight_read_bytes(weights, dirs[weights], config, args.torch_dtype)
        for kv in args.kv:
            name = f"{weights}_{kv}"
            run: dict[str, Any] = {"weights": weights, "kv": kv, "weight_read_bytes": w_bytes}
            left = args.time_budget - (time.perf_counter() - t_start)
            # The previous run of these weights is the estimate of this one (the same prefills).
            estimate = last_wall.get(weights)
            if left <= 30 or (estimate is not None and estimate > left):
                run["skipped"] = (
                    f"time budget: {left:.0f} s left, the previous {weights} run took "
                    f"{estimate or 0:.0f} s"
                )
                logger.warning("skipping %s: %s", name, run["skipped"])
                runs.append(run)
                write_json(args.out, result)
                continue
            spec = {
                "model": str(dirs[weights]),
                "dtype": args.dtype,
                "device": device,
                "kv": kv,
                "bound": bound,
                "contexts": args.contexts,
                "prompts": {str(c): n for c, n in prompts.items()},
                "ttft_context": args.ttft_context,
                "output_len": args.output_len,
                "warmup_len": args.warmup_len,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "prefix_caching": None if state_seq else True,
                "seed": args.seed,
                "out": str(work / f"{name}.json"),
            }
            logger.info("%s: bound %d, contexts %s", name, bound, args.contexts)
            t0 = time.perf_counter()
            res = run_point(args, spec, left)
            run["wall_s"] = last_wall[weights] = time.perf_counter() - t0
            run.update(res)
            kv_tok = kv_elem_tok * kv_bytes_per_element(kv, args.torch_dtype)
            add_floors(run, w_bytes, kv_tok, bw, state_seq)
            runs.append(run)
            write_json(args.out, result)
    ctx = args.ratio_context if args.ratio_context in args.contexts else max(args.contexts)
    result["kv_speed_ratios"] = kv_ratios(runs, ctx)
    for r in runs:
        if r.get("skipped"):
            continue
        for key, err in r.get("errors", {}).items():
            result["errors"][f"{r['weights']}_{r['kv']}_{key}"] = err


# ---------------------------------------------------------------------------------------------
# --fit: the longest context under a memory budget, served with one request


# kv_sizing.decide_num_blocks's refusal of a max_model_len the KV cache cannot hold.
REFUSAL = re.compile(r"the KV cache fits (\d+) blocks \((\d+) tokens")


def fit_budget(args, budget: str, model_dir: Path, work: Path) -> dict[str, Any]:
    """`voltserve serve` under --max-gpu-memory `budget` asked for the model's whole context;
    where the executor refuses it (the KV cache cannot hold one such sequence), again at the
    length its refusal names; then one completion request of that length, prompt as token ids."""
    from load_tests.bench_serving import launched_server
    from load_tests.serve_stack import http_json

    # The server's own defaults otherwise (its step budget sets the activation reserve).
    base_args = ["--max-gpu-memory", budget, "--kv-cache-dtype", args.fit_kv]
    base_args += [*args.fit_serve_args.split(), "--log-level", "info"]
    out: dict[str, Any] = {"budget": budget, "weights": args.fit_weights, "kv": args.fit_kv}
    out["attempts"] = attempts = []
    length = args.max_positions
    for i in range(4):
        serve_args = [*base_args, "--max-model-len", str(length)]
        log_path = work / f"fit_{budget}_{i}.log"
        t0 = time.perf_counter()
        try:
            with launched_server(model_dir, serve_args, log_path, args.launch_timeout) as url:
                attempts.append(
                    {"max_model_len": length, "accepted": True, "start_s": time.perf_counter() - t0}
                )
                out["max_model_len"] = length
                out["request"] = fit_request(url, length, args, http_json)
                out["server_log"] = str(log_path)
                out["memory_log"] = grep(log_path, "memory: total")
                out["kv_log"] = grep(log_path, "KV blocks of")
                return out
        except RuntimeError as e:
            log = log_path.read_text(errors="replace") if log_path.is_file() else str(e)
            m = REFUSAL.search(log)
            attempts.append(
                {
                    "max_model_len": length,
                    "accepted": False,
                    "start_s": time.perf_counter() - t0,
                    "refusal": m.group(0) if m else None,
                }
            )
            if m is None or int(m.group(2)) >= length:
                out["error"] = f"server did not start: {str(e)[-2000:]}"
                return out
            length = int(m.group(2))
    out["error"] = "no length was accepted"
    return out


def grep(path: Path, needle: str) -> list[str]:
    return [ln for ln in path.read_text(errors="replace").splitlines() if needle in ln]


def fit_request(url: str, length: int, args, http_json) -> dict[str, Any]:
    """One /v1/completions request whose prompt and output fill `length` tokens exactly."""
    n_out = args.fit_output_len
    cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    prompt = random_tokens(args.seed + 2, length - n_out, cfg["vocab_size"])
    body = {
        "model": http_json(url + "/v1/models")[1]["data"][0]["id"],
        "prompt": prompt,
        "max_tokens": n_out,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    status, reply = http_json(url + "/v1/completions", body, timeout=args.launch_timeout + 900)
    wall = time.perf_counter() - t0
    usage = (reply or {}).get("usage") or {}
    ok = (
        status == 200
        and usage.get("prompt_tokens") == length - n_out
        and usage.get("completion_tokens") == n_out
    )
    return {
        "status": status,
        "ok": ok,
        "wall_s": wall,
        "usage": usage,
        "finish_reason": ((reply or {}).get("choices") or [{}])[0].get("finish_reason"),
        "error": None if status == 200 else reply,
    }


def main_fit(args, result: dict[str, Any]) -> None:
    dirs = ensure_checkpoints(args, "cuda", result)
    release_cached_memory("cuda")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="voltserve-longctx-fit-"))
    work.mkdir(parents=True, exist_ok=True)
    result["fit"] = fits = []
    for budget in args.fit:
        logger.info("fit: %s, %s weights, kv %s", budget, args.fit_weights, args.fit_kv)
        fits.append(fit_budget(args, budget, dirs[args.fit_weights], work))
        write_json(args.out, result)
        f = fits[-1]
        if f.get("error") or not f.get("request", {}).get("ok"):
            result["errors"][f"fit_{budget}"] = f.get("error") or f.get("request")


# ---------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in names if x not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {allowed}")
        return names

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    p.add_argument("--rope", choices=("llama3", "yarn", "native"), default="llama3")
    add_layers_argument(p)
    p.add_argument(
        "--max-positions",
        type=int,
        default=LONGEST,
        help="max_position_embeddings written in the checkpoint",
    )
    p.add_argument("--model-dir", help="the fp16 checkpoint folder (written once, reused)")
    p.add_argument("--awq-dir", help="its AWQ copy (default: MODEL_DIR-awq-gGROUP)")
    p.add_argument("--awq-group", type=int, default=128, help="AWQ quantization group")
    p.add_argument("--weights", type=_names(WEIGHTS), default=list(WEIGHTS))
    p.add_argument("--kv", type=_names(KV_CACHE_DTYPES), default=["auto", "fp8_e5m2", "fp8_e4m3"])
    p.add_argument("--contexts", type=_ints, default=[4096, 32768, 131072, LONGEST])
    p.add_argument(
        "--ttft-context",
        type=int,
        default=131072,
        help="the context prefilled from nothing first (its TTFT and peak memory)",
    )
    p.add_argument(
        "--ratio-context", type=int, default=131072, help="context of the fp8 / fp16 ratios"
    )
    p.add_argument("--output-len", type=int, default=128, help="decode tokens per context")
    p.add_argument("--warmup-len", type=int, default=1024, help="the warm-up request's prompt")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="prefill chunk")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="the engines' bound (default: see above)"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: float16 on CUDA, float32 on CPU")
    p.add_argument(
        "--time-budget",
        type=float,
        default=float("inf"),
        help="seconds for the whole run: a (weights, kv) run that the previous run of the "
        "same weights says would not finish is skipped, a running one stopped at the limit",
    )
    p.add_argument("--in-process", action="store_true", help="run the engines in this process")
    p.add_argument("--work-dir", help="the workers' JSON and logs (default: a temporary folder)")
    p.add_argument(
        "--fit",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=None,
        help="e.g. 16GiB,32GiB: the longest context under each --max-gpu-memory budget",
    )
    p.add_argument("--fit-weights", choices=WEIGHTS, default="awq")
    p.add_argument("--fit-kv", choices=KV_CACHE_DTYPES, default="fp8_e5m2")
    p.add_argument("--fit-output-len", type=int, default=16)
    p.add_argument("--fit-serve-args", default="", help="more `voltserve serve` flags for --fit")
    p.add_argument("--launch-timeout", type=float, default=600.0)
    p.add_argument("--bandwidth-bytes", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON results file (rewritten after every run)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.max_model_len and args.max_model_len > args.max_positions:
        p.error(f"--max-model-len {args.max_model_len} exceeds --max-positions")
    if max(args.contexts) > args.max_positions:
        p.error(f"--contexts reach past --max-positions {args.max_positions}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("numba").setLevel(logging.WARNING)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        res = run_worker(spec)
        return 1 if res["errors"] else 0
    t_start = time.perf_counter()
    device = resolve_device(args.device)
    if args.fit and not device.startswith("cuda"):
        raise SystemExit("--fit needs a CUDA device (--max-gpu-memory budgets GPU memory)")
    from load_tests.common import resolve_dtype

    args.torch_dtype = resolve_dtype(args.dtype, device)
    if not args.model_dir:
        args.model_dir = str(
            Path(tempfile.gettempdir())
            / f"voltserve-{args.preset}-{args.rope}-{args.max_positions}"
            f"{f'-l{args.layers}' if args.layers else ''}"
        )
    result: dict[str, Any] = {
        "benchmark": "long_context",
        "preset": args.preset,
        "rope": rope_overrides(args.preset, args.rope, args.max_positions),
        "layers": args.layers,
        "device": device,
        "env": env_info(device),
        "args": {k: v for k, v in vars(args).items() if k != "torch_dtype"},
        "errors": {},
    }
    logger.info("measuring copy bandwidth on %s", device)
    result["copy_bandwidth"] = measure_copy_bandwidth(device, args.bandwidth_bytes)
    try:
        if args.fit:
            main_fit(args, result)
        else:
            main_bench(args, device, result, t_start)
    except Exception as e:
        traceback.print_exc()
        result["errors"]["run"] = f"{type(e).__name__}: {e}"
    result["wall_s"] = time.perf_counter() - t_start
    write_json(args.out, result)
    print_table(result)
    return 1 if result["errors"] else 0


def print_table(result: dict[str, Any]) -> None:
    bw = result.get("copy_bandwidth", {})
    print()
    print(
        f"long context: {result['preset']} on {result['env'].get('device_name')}, copy "
        f"bandwidth {cell(bw.get('bandwidth_GBps'), '.0f')} GB/s, bound {result.get('bound')}"
    )
    if result.get("runs"):
        print(
            f"{'weights':<8}{'kv':<10}{'context':>9}{'tok/s':>9}{'floor':>9}{'of floor':>9}"
            f"{'TTFT s':>9}{'computed':>10}{'act GiB':>9}"
        )
    for r in result.get("runs", []):
        if r.get("skipped"):
            print(f"{r['weights']:<8}{r['kv']:<10} skipped: {r['skipped']}")
            continue
        for p in r.get("points", []):
            act = p.get("prefill_activation_bytes")
            print(
                f"{r['weights']:<8}{r['kv']:<10}{p['context']:>9}"
                f"{cell(p.get('decode_tok_s'), '.1f'):>9}{cell(p.get('floor_tok_s'), '.1f'):>9}"
                f"{cell(p.get('fraction_of_floor'), '.1%'):>9}{cell(p.get('ttft_s'), '.1f'):>9}"
                f"{p['prefill_tokens_computed']:>10}"
                f"{cell(act / 2**30 if act is not None else None, '.2f'):>9}"
            )
    for x in result.get("kv_speed_ratios", []):
        print(
            f"{x['weights']} {x['kv']} / {x['against']} at {x['context']}: speed "
            f"{x['speed_ratio']:.2f}x, floors {x['floor_ratio']:.2f}x "
            f"({x['speed_over_floor_ratio']:.2f} of it)"
        )
    for f in result.get("fit", []):
        req = f.get("request") or {}
        print(
            f"fit {f['budget']}: max_model_len {f.get('max_model_len')}, request ok "
            f"{req.get('ok')} in {cell(req.get('wall_s'), '.1f')} s"
        )
    for k, v in result["errors"].items():
        print(f"ERROR {k}: {str(v)[:500]}")


if __name__ == "__main__":
    sys.exit(main())
