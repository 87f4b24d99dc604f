"""Prefill attention speed: the flash kernel (kernels/attention/prefill_fa.py, wmma with the whole
key loop in linked C++, `flash`: what the engine runs for head dims 64, 128 and 256) vs the
CUDA-core numba kernel (kernels/attention/prefill.py, `numba_cuda_core`: the engine's fallback
for other head dims) vs torch's scaled_dot_product_attention on contiguous tensors (`sdpa`:
whatever backend torch picks, flash or memory-efficient on SM80+, math or efficient on SM70).

    python load_tests/bench_prefill_attention.py --out results/bench_prefill_attention.json
    python load_tests/bench_prefill_attention.py --prompts 1024,4096,16384,32768 --seqs 1,8 \
        --kernels flash,sdpa --out bench_prefill_attention.json
    python load_tests/bench_prefill_attention.py --heads 24 --kv-heads 4 --head-dim 256 \
        --prompts 4096,32768 --kernels flash,sdpa --out bench_prefill_attention_qwen35.json

Shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128) unless --heads,
--kv-heads and --head-dim say otherwise (Qwen3.5-27B's full-attention layers: 24, 4 and 256),
`seqs` sequences of P prompt tokens each (default 1024 and 4096), fp16, causal. Timing: CUDA
events around each call, warmup first, median of the repeats. TFLOP/s counts the causal work
only: 2 matmuls x 2 flops x H x D x P (P + 1) / 2 per sequence. Each kernel's output (a fresh
NaN-filled buffer, so an unwritten element shows) is compared with SDPA's: max abs difference
and relative norm, `ok` when within MAX_ABS_DIFF / MAX_REL_NORM and free of NaN; the exit status
is 1 when any is not. `flash_speedup_over_cuda_core` in a run is numba_cuda_core's time over
flash's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)

BLOCK = 16
KERNELS = ("flash", "sdpa", "numba_cuda_core")
# Agreement with SDPA (itself fp16 with fp32 sums: ~1e-3 from exact at worst): the kernels
# measured 1e-3 to 2e-3 max abs difference; a wrong mask or rescale is off by O(1).
MAX_ABS_DIFF = 1e-2
MAX_REL_NORM = 3e-3


def time_call(fn, warmup: int, repeats: int) -> float:
    """Median seconds of one fn() call (CUDA events on the current stream)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def bench(
    prompt: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    warmup: int,
    repeats: int,
    seqs: int = 1,
    rounds: int = 1,
    kernels: tuple[str, ...] = KERNELS,
):
    """seqs sequences of `prompt` tokens each in one launch (a serving prefill step packs
    8192 tokens: 8 x 1024); rounds: times each kernel that many times, all kernels in turn, and
    reports the median; kernels: which of KERNELS to time."""

    gen = torch.Generator(device="cuda").manual_seed(0)
    per_seq = (prompt + BLOCK - 1) // BLOCK
    n_blocks = seqs * per_seq
    T = seqs * prompt
    q = torch.randn((T, heads, head_dim), generator=gen, device="cuda").half()
    k = torch.randn((seqs, prompt, kv_heads, head_dim), generator=gen, device="cuda").half()
    v = torch.randn((seqs, prompt, kv_heads, head_dim), generator=gen, device="cuda").half()
    # Paged cache: sequence s's block i holds its tokens 16i..16i+15; blocks shuffled.
    pad = per_seq * BLOCK - prompt
    perm = torch.randperm(n_blocks, generator=gen, device="cuda")
    table = perm.int().view(seqs, per_seq)

    def paged(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        blocks = x.reshape(n_blocks, BLOCK, kv_heads, head_dim).permute(0, 2, 1, 3)
        cache = torch.empty_like(blocks.contiguous())
        cache[perm] = blocks
        return cache.contiguous()

    k_cache, v_cache = paged(k), paged(v)
    seq_lens = torch.full((seqs,), prompt, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, T + 1, prompt, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    flops = seqs * 4.0 * heads * head_dim * prompt * (prompt + 1) / 2

    # SDPA on contiguous [S, H, P, D] tensors (KV heads repeated: what a plain model does).
    group = heads // kv_heads
    qs = q.view(seqs, prompt, heads, head_dim).transpose(1, 2).contiguous()
    ks = k.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
    vs = v.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale
        )

    def flat(x):  # [S, H, P, D] -> [S * P, H, D]
        return x.transpose(1, 2).reshape(T, heads, head_dim)

    ref = flat(sdpa()).float()
    rows = {}

    def paged(launcher):  # a paged kernel writing into `out` (its own buffer by default)
        def call(out=None):
            args = (q, k_cache, v_cache, table, seq_lens, qsl, scale, out)
            return launcher(*args, max_query_len=prompt)

        return functools.partial(call, out=torch.empty_like(q))

    fns = {}
    if "flash" in kernels:
        # The flash kernel itself (the engine's entry, paged_attention_cuda, would hand a head
        # dim it does not cover to the CUDA-core kernel; this reports the error instead).
        from voltserve.kernels.attention.prefill_fa import paged_attention_fa_cuda

        fns["flash"] = paged(paged_attention_fa_cuda)
    if "sdpa" in kernels:
        fns["sdpa"] = sdpa
    if "numba_cuda_core" in kernels:
        from voltserve.kernels.attention.prefill import paged_attention_cuda

        fns["numba_cuda_core"] = paged(paged_attention_cuda)
    kernels = fns
    # Rounds go over every kernel in turn, so a drift of the card (clocks under its power cap)
    # lands on all of them alike; each kernel reports the median of its rounds.
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, fn in kernels.items():
            if name in rows:  # failed in an earlier round
                continue
            try:
                times[name].append(time_call(fn, warmup, repeats))
            except Exception as e:  # noqa: BLE001 - reported in the JSON, the others still run
                rows[name] = {"error": f"{type(e).__name__}: {e}"}
    for name, fn in kernels.items():
        if name in rows:
            continue
        t = statistics.median(times[name])
        if name == "sdpa":
            got = flat(fn())
        else:  # a fresh NaN-filled buffer: an element the kernel leaves unwritten shows
            got = fn(out=torch.full_like(q, float("nan")))
        torch.cuda.synchronize()
        diff = got.float() - ref
        max_abs = diff.abs().max().item()
        rel = (diff.norm() / ref.norm()).item()
        nan = bool(got.isnan().any().item())
        del got, diff
        rows[name] = {
            "ms": t * 1e3,
            "round_ms": [x * 1e3 for x in times[name]],
            "tflops": flops / t / 1e12,
            "max_abs_diff_vs_sdpa": max_abs,
            "rel_norm_vs_sdpa": rel,
            "nan": nan,
            "ok": (not nan) and max_abs <= MAX_ABS_DIFF and rel <= MAX_REL_NORM,
        }
    speedup = None
    if "ms" in rows.get("flash", {}) and "ms" in rows.get("numba_cuda_core", {}):
        speedup = rows["numba_cuda_core"]["ms"] / rows["flash"]["ms"]
    return {
        "sequences": seqs,
        "prompt_tokens": prompt,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "causal_flops": flops,
        "flash_speedup_over_cuda_core": speedup,
        "kernels": rows,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", default="1024,4096")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument(
        "--seqs", default="1", help="sequences per launch, one run per entry (e.g. 1,8)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every kernel this many times, in turn, and report the median (the same "
        "kernel built twice measured 20%% apart in one run on an H200)",
    )
    ap.add_argument(
        "--kernels",
        default=",".join(KERNELS),
        help=f"which kernels to time, comma-separated, of {','.join(KERNELS)} (default: all; "
        "the CUDA-core kernel takes seconds a call at 8 x 32768)",
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill_attention needs a CUDA GPU")
    results = {
        "device": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "runs": [],
    }
    kernels = tuple(x.strip() for x in args.kernels.split(",") if x.strip())
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise SystemExit(f"unknown --kernels {sorted(unknown)}; choose from {KERNELS}")
    for n in (int(x) for x in args.seqs.split(",")):
        for p in (int(x) for x in args.prompts.split(",")):
            r = bench(
                p,
                args.heads,
                args.kv_heads,
                args.head_dim,
                args.warmup,
                args.repeats,
                n,
                args.rounds,
                kernels,
            )
            results["runs"].append(r)
            for name, row in r["kernels"].items():
                if "error" in row:
                    print(f"{n}xP={p:<6} {name:<20} ERROR {row['error']}")
                else:
                    print(
                        f"{n}xP={p:<6} {name:<20} {row['ms']:8.3f} ms {row['tflops']:7.2f} "
                        f"TFLOP/s max|diff| vs sdpa {row['max_abs_diff_vs_sdpa']:.2e} "
                        f"rel {row['rel_norm_vs_sdpa']:.2e}{'' if row['ok'] else '  MISMATCH'}"
                    )
            speedup = r["flash_speedup_over_cuda_core"]
            if speedup is not None:
                print(f"{n}xP={p:<6} flash speedup over numba_cuda_core {speedup:.2f}x")
            # Incremental: a run cut short by a time limit keeps what it measured.
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2))
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    bad = [
        f"{r['sequences']}x{r['prompt_tokens']} {name}"
        for r in results["runs"]
        for name, row in r["kernels"].items()
        if "error" in row or not row["ok"]
    ]
    if bad:
        raise SystemExit(f"kernels that failed or disagree with SDPA: {', '.join(bad)}")


if __name__ == "__main__":
    main()
