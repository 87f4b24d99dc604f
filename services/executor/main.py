"""`voltserve executor`: one engine (one GPU) behind Redis streams."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import signal
import socket

from voltserve.shared import broker, startup
from voltserve.shared.config import EngineConfig
from voltserve.shared.logging import add_log_level_flag, setup_logging

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="voltserve executor", description=__doc__)
    p.add_argument(
        "--model", required=True, help="Hugging Face checkpoint folder or GGUF file / folder"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float16", "half", "bfloat16", "float32", "float"],
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="fixed KV cache size in blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--cuda-graph-sizes",
        type=graph_sizes,
        default=(),
        help="decode batch sizes to capture, comma-separated (default 1,2,4,8,16,24,...)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs (one process each) that run the model as one executor; rank r uses the r-th "
        "visible GPU",
    )
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        help='speculative decoding, vLLM\'s JSON keys: {"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}; '
        'methods "draft_model" and "eagle" take "model": the draft / EAGLE head folder',
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["awq", "gptq", "compressed-tensors", "gguf"],
        help="force the quantization method (default: from the checkpoint)",
    )
    p.add_argument(
        "--max-gpu-memory",
        type=memory_size,
        default=None,
        help="GPU memory budget (bytes, or 16GiB / 16GB ...): KV sizing uses min(card, budget)",
    )
    p.add_argument(
        "--executor-id",
        default=os.environ.get("VOLTSERVE_EXECUTOR_ID") or f"{socket.gethostname()}-{os.getpid()}",
    )
    broker.add_broker_flags(p)
    p.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds")
    p.add_argument(
        "--heartbeat-ttl",
        type=float,
        default=3.0,
        help="seconds; the scheduler fails over after this",
    )
    p.add_argument("--served-model-name", default=None, help="model_name label of the metrics")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    add_log_level_flag(p)
    return p


def graph_sizes(text: str) -> tuple[int, ...]:
    """--cuda-graph-sizes: "1,8,64" -> (1, 8, 64); every size a positive integer."""
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers: {text!r}")
    return sizes


def speculative_config(text: str) -> dict:
    """--speculative-config: a JSON object with vLLM's keys, validated here so a bad one is a
    usage error naming the key, not a failure at engine start."""
    from voltserve.services.executor.spec.config import SpeculativeConfig

    try:
        return json.loads(SpeculativeConfig.from_json(text).to_json())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9}
_UNITS.update({"gb": 10**9, "t": 10**12, "tb": 10**12})
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def memory_size(text: str) -> int:
    """--max-gpu-memory: "17179869184", "16GiB", "16GB", "16g", "1.5 TiB" -> bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m[2].lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"not a memory size: {text!r} (bytes, or a number with KB/MB/GB/TB or KiB/MiB/GiB/TiB)"
        )
    n = int(float(m[1]) * _UNITS[unit])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"memory size must be positive: {text!r}")
    return n


def engine_config(args: argparse.Namespace) -> EngineConfig:
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    return EngineConfig(
        model=args.model,
        dtype=dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        cuda_graph_sizes=args.cuda_graph_sizes,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=args.speculative_config,
        quantization=args.quantization,
        max_gpu_memory=args.max_gpu_memory,
    )


def service_config(args: argparse.Namespace):
    """The service half of the executor flags (shared with load_tests/synthetic_executor.py)."""
    from voltserve.services.executor.service import ServiceConfig

    return ServiceConfig(
        executor_id=args.executor_id,
        redis_url=args.redis_url,
        model=args.model,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_ttl_s=args.heartbeat_ttl,
        max_num_seqs=args.max_num_seqs,
        redis_outage_timeout_s=args.redis_outage_timeout,
    )


def run_until_signalled(svc) -> None:
    """Runs an ExecutorService until SIGINT or SIGTERM asks it to stop."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, svc.stop.set)
        await svc.run()

    asyncio.run(run())


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(f"executor:{args.executor_id}", args.log_level, args.log_json)
    # `kill -USR1 <pid>` prints every thread's stack: the way to see what a stuck engine does.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Imported here so `--help` does not pay for torch.
    from voltserve.services.executor.engine import LLMEngine
    from voltserve.services.executor.service import ExecutorService

    # A failure that a restart cannot fix (the model, a flag, the memory) exits with
    # startup.FATAL_EXIT_CODE and its reason, so the launcher stops instead of retrying.
    with startup.fatal_errors(f"executor {args.executor_id}"):
        engine = LLMEngine(engine_config(args))
    svc = ExecutorService(engine, service_config(args))

    if args.metrics_port:
        from voltserve.shared import metrics

        metrics.serve_executor_metrics(
            args.metrics_port,
            args.executor_id,
            args.served_model_name or args.model,
            lambda: metrics.status_fields(svc.loop_.latest_stats, [svc.loop_.queue_time]),
        )

    startup.freeze_heap()
    try:
        run_until_signalled(svc)
    finally:
        engine.runner.shutdown()  # the other tensor-parallel ranks, if any
    logger.info("executor %s exited", args.executor_id)
