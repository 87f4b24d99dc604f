"""`voltserve warmup --model DIR [serve flags]`: compile every kernel `voltserve serve` with the
same flags launches at start-up into the kernel cache ($VOLTSERVE_CACHE_DIR, default
~/.cache/voltserve), then exit. A later `serve` loads them instead of compiling.

It builds executor 0's engine from the serve flags (the kernels depend on the model's shape, the
dtype, --max-model-len, --max-num-seqs and --cuda-graph-sizes), loads the weights, and runs the
engine's compile phase (services/executor/kernel_warmup.py) on the GPU; it sizes no KV cache and
captures no graphs. On a machine without a GPU there is nothing to compile.

Container images: run it once on the target GPU type with the cache folder on a volume (or
`docker commit` the result); see compose/README.md.
"""

from __future__ import annotations

import os
import sys

from voltserve.kernels.runtime import compile_cache
from voltserve.services import launcher
from voltserve.services.executor.engine_args import engine_config
from voltserve.shared import startup
from voltserve.shared.logging import setup_logging


def main(argv: list[str]) -> None:
    p = launcher.build_parser()
    p.prog = "voltserve warmup"
    p.description = __doc__
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"compile worker processes (default: ${compile_cache.JOBS_ENV} or CPUs - 1, up to 8)",
    )
    args = p.parse_args(argv)
    setup_logging("warmup", args.log_level, args.log_json)
    if not os.path.exists(args.model):
        p.exit(1, f"voltserve warmup: --model {args.model} does not exist\n")
    if args.jobs is not None:
        os.environ[compile_cache.JOBS_ENV] = str(max(1, args.jobs))
    # The serve flags hold every engine flag (engine_args.py): executor 0's config.
    config = engine_config(args)

    with startup.fatal_errors("warmup"):
        # Imported here so `--help` does not pay for torch.
        from voltserve.services.executor.model_runner import ModelRunner, resolve_device

        if resolve_device(config.device).type != "cuda":
            print("voltserve warmup: no GPU: nothing to compile (kernels run on CUDA only)")
            return
        runner = ModelRunner(config, compile_only=True)
    report = runner.compile_report
    where = compile_cache.kernel_dir()
    if report is None:
        print(f"voltserve warmup: no numba kernels to compile for this model; cache {where}")
        return
    print(
        f"voltserve warmup: {report.summary()} in {report.seconds:.1f} s; cache {where}",
        file=sys.stdout,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
