"""Tensor parallelism through the real services on the CPU (gloo, 2 ranks): `voltserve serve
--tensor-parallel-size 2` answers greedy requests with transformers' tokens and registers one
executor; and kill -9 of rank 1 takes its executor down loudly (non-zero exit) while every
in-flight request finishes on the other executor with the undisturbed output."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.checkpoints import greedy_tokens
from voltserve.cli import command as voltserve_command

from .conftest import Valkey, free_port, start_stack
from .test_faults import client, reference_batch, routes_on, stream_completion

VOCAB = 384


def rank_pids(parent: int) -> list[int]:
    """The tensor-parallel rank processes (multiprocessing spawn children) of `parent`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"spawn_main" in cmd:
            out.append(int(d.name))
    return out


@functools.cache
def _hf_model(model: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def hf_tokens(model: Path, prompt: list[int], n: int) -> list[int]:
    return greedy_tokens(_hf_model(model), prompt, n)


async def test_serve_tensor_parallel_2_matches_transformers(tiny_model, tmp_path):
    valkey = Valkey()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    argv = [*voltserve_command(), "serve", "--model", str(tiny_model)]
    argv += ["--tensor-parallel-size", "2", "--device", "cpu", "--port", str(port)]
    argv += ["--host", "127.0.0.1", "--redis-url", valkey.url, "--served-model-name", "tiny"]
    argv += ["--num-kv-blocks", "256", "--max-num-seqs", "16", "--log-level", "warning"]
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "serve -tp 2 not ready"
            await asyncio.sleep(0.3)
        rng = random.Random(random.getrandbits(64))  # from the per-test seed (tests/conftest.py)
        prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(4)]
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120)

        async def tokens(p):
            r = await c.completions.create(
                model="tiny",
                prompt=p,
                max_tokens=8,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )
            return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]

        got = await asyncio.gather(*(tokens(p) for p in prompts))
        for p, g in zip(prompts, got):
            assert g == hf_tokens(tiny_model, p, 8), p
        r = valkey.client()
        try:  # one TP group, one executor
            assert {x.decode() for x in r.smembers("vs:executors")} == {"exec-0"}
        finally:
            r.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        valkey.stop()


@pytest.fixture
def tp_stack(tiny_model, tmp_path):
    """executor-0: TP=2; executor-1: TP=1 (where executor-0's requests fail over)."""
    s = start_stack(tiny_model, tmp_path, executors=0, wait=False)
    try:
        s.add_executor("executor-0", "--tensor-parallel-size", "2")
        s.add_executor("executor-1")
        s.wait_ready()
    except BaseException:
        s.stop()
        raise
    yield s
    s.stop()


async def test_rank_killed_takes_the_executor_down_and_requests_fail_over(tp_stack):
    s = tp_stack
    rng = random.Random(random.getrandbits(64))  # from the per-test seed (tests/conftest.py)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    max_tokens = 300
    c = client(s)
    ref = await reference_batch(c, prompts, max_tokens)
    ranks = rank_pids(s.procs["executor-0"].pid)
    assert len(ranks) == 1, ranks
    progress: dict[int, int] = {}
    tasks = [
        asyncio.create_task(stream_completion(c, p, max_tokens, progress, i))
        for i, p in enumerate(prompts)
    ]
    while sum(progress.values()) < 2 * len(prompts):
        await asyncio.sleep(0.002)
        assert not any(t.done() and t.exception() for t in tasks)
    # Rank 0 frozen (so the TP group surely holds requests), rank 1 killed, rank 0 resumed.
    s.pause("executor-0")
    owned = routes_on(s, "executor-0")
    os.kill(ranks[0], signal.SIGKILL)
    s.resume("executor-0")
    p0 = s.procs.pop("executor-0")
    code = p0.wait(timeout=30)
    assert code != 0
    assert "tensor-parallel rank 1" in s.logs("executor-0")
    got = await asyncio.gather(*tasks)
    assert owned > 0, "the TP executor had no unfinished request when its rank was killed"
    assert got == ref
