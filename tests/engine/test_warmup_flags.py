"""`voltserve warmup` builds its engine from `voltserve serve`'s flags exactly as serve's first
executor gets them (the kernels it compiles depend on them), and on a machine without a GPU it
says there is nothing to compile and exits 0."""

from __future__ import annotations

import os
import subprocess

from voltserve.services import launcher
from voltserve.services.executor import main as executor_main
from voltserve.services.executor.engine_args import engine_config

from voltserve.cli import command as voltserve_command


def test_warmup_engine_config_is_the_first_executors():
    flags = ["--model", "m", "--max-model-len", "4096", "--max-num-seqs", "64", "--dtype"]
    flags += ["float16", "--cuda-graph-sizes", "1,8,64", "--enforce-eager", "--device", "cuda"]
    flags += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    flags += ["--quantization", "awq", "--max-gpu-memory", "16GiB"]
    args = launcher.build_parser().parse_args(flags)
    (child,) = [c for c in launcher.build_children(args, "redis://x") if c.name == "executor-0"]
    served = executor_main.engine_config(executor_main.build_parser().parse_args(child.argv[1:]))
    warm = engine_config(args)  # what services/executor/warmup.py builds
    assert warm == served
    assert warm.max_model_len == 4096 and warm.cuda_graph_sizes == (1, 8, 64)
    assert warm.enforce_eager and warm.max_num_seqs == 64
    assert warm.speculative_config.method == "ngram"
    assert warm.speculative_config.num_speculative_tokens == 2
    assert warm.quantization == "awq" and warm.max_gpu_memory == 16 * 2**30


def test_warmup_without_a_gpu_has_nothing_to_compile(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [*voltserve_command(), "warmup", "--model", str(tmp_path), "--device"] + ["cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing to compile" in proc.stdout
    missing = subprocess.run(
        [*voltserve_command(), "warmup", "--model", str(tmp_path / "no")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert missing.returncode == 1 and "does not exist" in missing.stderr
