"""MoE experts at decode on the GPU, fp16 against group-quantized: per token count (1..8), the
time of one layer's routed experts through the fp16 decode kernels (kernels/moe/decode.py) and
through the fused int4 g128 (AWQ / GPTQ) and int8 g32 (GGUF Q8_0) kernels
(kernels/moe/quant_decode.py), with the HBM copy bandwidth measured in the same run and each
path's fraction of its bytes-read floor (the distinct routed experts' weights, codes + scales +
offsets, over the copy bandwidth).

Shape: Qwen3-30B-A3B's experts (hidden 2048, 128 experts, top-8, expert intermediate 768).
Every point: CUDA-graph replays cycling over ROUTINGS random routings (so consecutive calls
read mostly different experts and the routed weights stream from HBM, not L2), timed with
events, median of 7.

    python load_tests/bench_moe_quant.py --out bench_moe_quant.json [--tokens 1,2,4,8]

--topk times the router's top-k instead (kernels/moe/routing.py moe_topk_cuda: softmax, top-k,
normalisation in one launch) at each family's router shape, us per call from CUDA-graph replays
of back-to-back calls on the same logits (they stay in L2, as the router GEMV leaves them):

    python load_tests/bench_moe_quant.py --topk --topk-tokens 1,256 --out bench_moe_topk.json
"""

# Every lambda below is timed (called) before its loop variables change:
# ruff: noqa: B023
from __future__ import annotations

import argparse
import itertools

import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)

from load_tests.bench_attention import time_graph  # noqa: E402
from load_tests.common import env_info, measure_copy_bandwidth, write_json  # noqa: E402

H, E, TOP_K, INTER = 2048, 128, 8, 768
ROUTINGS = 16
FORMATS = {"int4_g128": (4, 128), "int8_g32": (8, 32)}


def packed(rows: int, K: int, bits: int, g: int, gen):
    from voltserve.kernels.linear.quant_pack import pack_group_quant

    codes = torch.randint(0, 2**bits, (rows, K), generator=gen, device="cuda", dtype=torch.uint8)
    s = (torch.rand(rows, K // g, generator=gen, device="cuda") + 0.5) * (0.04 / 2**bits)
    return pack_group_quant(codes, s, -s * 2 ** (bits - 1), bits, g, torch.float16)


def routings(T: int, gen) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(ROUTINGS):
        ids = torch.stack(
            [torch.randperm(E, generator=gen, device="cuda")[:TOP_K] for _ in range(T)]
        ).to(torch.int32)
        w = torch.rand(T, TOP_K, generator=gen, device="cuda")
        out.append(((w / w.sum(-1, keepdim=True)).contiguous(), ids.contiguous()))
    return out


def expert_bytes(w13, w2) -> float:
    """Bytes of one expert's weights (w13 and w2): packed GroupQuantWeights or fp16 tensors."""

    def nbytes(w) -> int:
        if isinstance(w, torch.Tensor):
            return w.numel() * w.element_size()
        return w.nbytes()

    return (nbytes(w13) + nbytes(w2)) / E


# family -> (experts, top_k, renormalise, weights in the activation dtype), as models/moe.py
TOPK_ROUTERS = {
    "qwen3-moe": (128, 8, True, True),
    "qwen2-moe": (60, 4, False, True),
    "mixtral": (8, 2, True, False),
}


def bench_topk(tokens: list[int], seed: int) -> list[dict]:
    from voltserve.kernels.moe.routing import moe_topk_cuda, moe_topk_ref

    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    for family, (e, k, renorm, in_dtype) in TOPK_ROUTERS.items():
        wd = torch.float16 if in_dtype else torch.float32
        for T in tokens:
            logits = (torch.randn(T, e, device="cuda", generator=gen) * 2).half()
            w, _ = moe_topk_cuda(logits, k, renorm, wd)
            torch.testing.assert_close(
                w, moe_topk_ref(logits, k, renorm, wd)[0], atol=1e-3, rtol=1e-3
            )
            t = time_graph(lambda: moe_topk_cuda(logits, k, renorm, wd), iters=200, repeats=7)
            row = {"family": family, "experts": e, "top_k": k, "tokens": T, "us_per_call": t * 1e6}
            rows.append(row)
            print(f"top-k {family} (E={e}, k={k}) T={T}: {t * 1e6:.2f} us", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON results file")
    p.add_argument("--topk", action="store_true", help="time the router top-k only (see above)")
    p.add_argument("--topk-tokens", default="1,256", help="token counts of --topk")
    args = p.parse_args(argv)
    if args.topk:
        tokens = [int(t) for t in args.topk_tokens.split(",") if t]
        rows = bench_topk(tokens, args.seed)
        write_json(args.out, {"env": env_info("cuda"), "dtype": "float16", "topk": rows})
        return
    from voltserve.kernels.moe import quant_decode as mq
    from voltserve.kernels.moe.decode import moe_decode
    from voltserve.kernels.moe.experts import moe_experts_ref

    bw = measure_copy_bandwidth("cuda")
    gbps = bw["bandwidth_GBps"]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    w13 = torch.randn(E, 2 * INTER, H, device="cuda", generator=gen).mul_(H**-0.5).half()
    w2 = torch.randn(E, H, INTER, device="cuda", generator=gen).mul_(INTER**-0.5).half()
    quant = {
        name: (packed(E * 2 * INTER, H, bits, g, gen), packed(E * H, INTER, bits, g, gen))
        for name, (bits, g) in FORMATS.items()
    }
    per_expert = {"fp16": expert_bytes(w13, w2)}
    per_expert.update({n: expert_bytes(*q) for n, q in quant.items()})
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, device="cuda", generator=gen).half()
        sets = routings(T, gen)
        distinct = sum(len(set(ids.flatten().tolist())) for _, ids in sets) / len(sets)
        # correctness once per point: each path against its reference on the first routing
        wts, ids = sets[0]
        ref16 = moe_experts_ref(x, w13, w2, wts, ids)
        torch.testing.assert_close(moe_decode(x, w13, w2, wts, ids), ref16, atol=1e-2, rtol=1e-2)
        it = itertools.cycle(sets)
        t16 = time_graph(lambda: moe_decode(x, w13, w2, *next(it)), iters=2 * ROUTINGS, repeats=7)
        row = {"tokens": T, "distinct_experts": distinct, "fp16_us": t16 * 1e6}
        row["fp16_floor_fraction"] = distinct * per_expert["fp16"] / (gbps * 1e9) / t16
        for name, (q13, q2) in quant.items():
            assert mq.supports(x, q13, q2, TOP_K), name
            want = mq.moe_quant_experts_ref(x, q13, q2, wts, ids)
            got = mq.moe_quant_decode(x, q13, q2, wts, ids)
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
            it = itertools.cycle(sets)
            tq = time_graph(
                lambda: mq.moe_quant_decode(x, q13, q2, *next(it)), iters=2 * ROUTINGS, repeats=7
            )
            row[f"{name}_us"] = tq * 1e6
            row[f"{name}_floor_fraction"] = distinct * per_expert[name] / (gbps * 1e9) / tq
            row[f"{name}_speedup_vs_fp16"] = t16 / tq
        rows.append(row)
        print(
            f"T={T}: fp16 {row['fp16_us']:.1f} us ({row['fp16_floor_fraction']:.2f} of floor)  "
            + "  ".join(
                f"{n} {row[f'{n}_us']:.1f} us ({row[f'{n}_floor_fraction']:.2f} of floor, "
                f"{row[f'{n}_speedup_vs_fp16']:.2f}x fp16)"
                for n in quant
            ),
            flush=True,
        )
    write_json(
        args.out,
        {
            "env": env_info("cuda"),
            "shape": {"hidden": H, "experts": E, "top_k": TOP_K, "intermediate": INTER},
            "copy_bandwidth": bw,
            "expert_bytes": per_expert,
            "routings_cycled": ROUTINGS,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
