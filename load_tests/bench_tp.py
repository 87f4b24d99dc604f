"""Tensor parallelism on one host: Llama-3-8B shape, fp16, TP=2 against TP=1 in the same run.

1. NCCL all-reduce latency between the two GPUs, at the sizes a decode step reduces ([B, 4096]
   fp16 for B = 1, 64, 256), timed as 200 all-reduces captured in one CUDA graph (what the
   decode graphs replay), and eagerly.
2. bench_decode.py twice, each in its own process: TP=1 on the first GPU, then TP=2 on two.
   Batch 1 (decode tok/s) and batch 64/256 at 1K context (step time).
3. Floors measured in the same run: TP=1 reads all the weight bytes per token over the copy
   bandwidth; TP=2 reads half of them per GPU and pays (2 x layers + 2) collectives per step
   (one all-reduce after o_proj and after down_proj per layer, the embedding's all-reduce, the
   logits' all-gather), each at the measured latency.
4. --serving: bench_serving.py (1024 in / 256 out, 256 prompts) against `voltserve serve` with
   one TP=1 executor and with one TP=2 executor.

    python load_tests/bench_tp.py --model-dir /tmp/voltserve-llama3-8b --out results/tp.json

NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set for every process started.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)

TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
os.environ.update(TP_ENV)


def _allreduce_rank(rank: int, port: int, sizes: list[int], hidden: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=dev
    )
    out: dict[str, Any] = {}
    reps = 200
    for rows in sizes:
        x = torch.ones(rows, hidden, dtype=torch.float16, device=dev)
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        # Eager: host launch included.
        t = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        eager_us = (time.perf_counter() - t) / reps * 1e6
        # Captured: what a decode graph replays.
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                dist.all_reduce(x)
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            g.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / reps * 1e6)
        times.sort()
        out[str(rows)] = {"graph_us": times[len(times) // 2], "eager_us": eager_us}
    if rank == 0:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def measure_allreduce(sizes: list[int], hidden: int) -> dict[str, Any]:
    import torch.multiprocessing as mp
    from voltserve.services.executor.tp.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_allreduce_rank, args=(r, port, sizes, hidden, q)) for r in range(2)
    ]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return res


def run_decode(args, tp: int, out: Path, log: Path) -> dict[str, Any] | None:
    env = {**os.environ, **TP_ENV}
    gpus = args.gpus.split(",")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[:tp])
    cmd = [sys.executable, str(HERE / "bench_decode.py"), "--preset", "llama3-8b"]
    cmd += ["--model-dir", args.model_dir, "--skip-transformers", "--runs", str(args.runs)]
    cmd += ["--warmup", "1", "--batch-sizes", args.batch_sizes, "--context", "1024"]
    cmd += ["--tensor-parallel-size", str(tp), "--out", str(out)]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if not out.is_file():
        return {"error": f"bench_decode -tp {tp} exited {rc} without results (see {log})"}
    r = json.loads(out.read_text())
    r["rc"] = rc
    return r


def run_serving(args, tp: int, out: Path, log: Path) -> dict[str, Any]:
    env = {**os.environ, **TP_ENV}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(args.gpus.split(",")[:tp])
    cmd = [sys.executable, str(HERE / "bench_serving.py"), "--launch", args.model_dir]
    cmd += ["--num-prompts", "256", "--input-len", "1024", "--output-len", "256"]
    cmd += ["--no-plots", "--out", str(out), "--", "--executors", "1"]
    cmd += ["--tensor-parallel-size", str(tp)]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if not out.is_file():
        return {"error": f"bench_serving -tp {tp} exited {rc} without results (see {log})"}
    return {"rc": rc, **json.loads(out.read_text())}


def floors(tp1: dict, ar: dict[str, Any], layers: int) -> dict[str, Any]:
    """Batch-1 ms per token: TP=1 from bench_decode's own floor; TP=2 half the weight bytes per
    GPU plus the collectives at the measured (captured) latency."""
    bw = tp1["copy_bandwidth"]["bandwidth_GBps"] * 1e9
    wbytes = tp1["model"]["read_per_token_bytes"]
    collectives = 2 * layers + 2
    ar1 = ar["1"]["graph_us"] / 1e3
    tp2_ms = wbytes / 2 / bw * 1e3 + collectives * ar1
    return {
        "tp1_ms_per_token": wbytes / bw * 1e3,
        "tp2_ms_per_token": tp2_ms,
        "tp2_collectives_per_step": collectives,
        "tp2_collective_ms": collectives * ar1,
        "copy_bandwidth_GBps": bw / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", default="/tmp/voltserve-llama3-8b")
    p.add_argument("--gpus", default="0,1", help="the two GPUs (CUDA ids)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--serving", action="store_true", help="also bench_serving TP=1 vs TP=2")
    p.add_argument("--skip-decode", action="store_true", help="only --serving (own time budget)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from load_tests.common import env_info, write_json

    out = Path(args.out)
    work = out.parent
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "benchmark": "tensor_parallel",
        "preset": "llama3-8b",
        "env": env_info("cuda"),
        "tp_env": TP_ENV,
        "args": vars(args),
        "errors": {},
    }
    if not args.skip_decode:
        run_decode_part(args, result, work)
    if args.serving:
        s1 = run_serving(args, 1, work / "tp_serving_tp1.json", work / "tp_serving_tp1.log")
        s2 = run_serving(args, 2, work / "tp_serving_tp2.json", work / "tp_serving_tp2.log")
        result["serving"] = {"tp1": s1, "tp2": s2}
        if "error" in s1 or "error" in s2:
            result["errors"]["serving"] = "a bench_serving run failed"
    write_json(out, result)
    print(json.dumps({k: result.get(k) for k in ("allreduce", "floor", "batch1", "batched")}))
    return 1 if result["errors"] else 0


def run_decode_part(args, result: dict[str, Any], work: Path) -> None:
    try:
        result["allreduce"] = measure_allreduce([1, 64, 256], 4096)
    except Exception as e:  # noqa: BLE001 - the decode runs still count
        result["errors"]["allreduce"] = f"{type(e).__name__}: {e}"
    # TP=1 first: it writes the checkpoint when the folder does not hold it yet.
    tp1 = run_decode(args, 1, work / "tp_decode_tp1.json", work / "tp_decode_tp1.log")
    tp2 = run_decode(args, 2, work / "tp_decode_tp2.json", work / "tp_decode_tp2.log")
    result["tp1"], result["tp2"] = tp1, tp2
    ok = "engine" in tp1 and "engine" in tp2
    if ok and "allreduce" in result:
        layers = 32  # the llama3-8b preset
        fl = floors(tp1, result["allreduce"], layers)
        result["floor"] = fl
        t1, t2 = tp1["engine"]["ms_per_token"], tp2["engine"]["ms_per_token"]
        result["batch1"] = {
            "tp1_tok_s": tp1["engine"]["decode_tok_s"],
            "tp2_tok_s": tp2["engine"]["decode_tok_s"],
            "speedup": t1 / t2,
            "tp1_floor_fraction": fl["tp1_ms_per_token"] / t1,
            "tp2_floor_fraction": fl["tp2_ms_per_token"] / t2,
        }
        result["batched"] = [
            {
                "batch_size": a["batch_size"],
                "tp1_step_ms": a["step_ms"],
                "tp2_step_ms": b["step_ms"],
                "tp1_run_step_ms": a["run_step_ms"],
                "tp2_run_step_ms": b["run_step_ms"],
                "speedup": a["step_ms"] / b["step_ms"],
            }
            for a, b in zip(tp1.get("batched", []), tp2.get("batched", []))
        ]
    else:
        result["errors"]["decode"] = "a bench_decode run failed (see tp1/tp2)"


if __name__ == "__main__":
    sys.exit(main())
