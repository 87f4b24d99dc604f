"""Serving benchmark in the style of `vllm bench serve`: streams /v1/completions requests at an
OpenAI-compatible server and reports throughput and TTFT / TPOT / ITL / end-to-end latency.

Targets:
  --base-url URL            a server that is already running
  --launch MODEL_DIR        start `voltserve serve` on a free port, wait for /health, stop it after
                            (a Hugging Face folder, or a GGUF file or the folder holding it)
  --preset NAME             write a random-weight checkpoint of that shape (--model-dir or a temp
                            folder; --layers N: fewer layers, same widths), then launch it as above
Extra `voltserve serve` flags go in --serve-args "..." or after a bare `--`.

Structured outputs: --response-format json_schema sends every request with a JSON-schema
constraint (STRUCTURED_SCHEMA: an array of objects that cannot close before max_tokens, so
output lengths match the plain run); --compare-structured runs the HTTP phase twice against
one server, plain then constrained, and reports both and the constrained path's cost
(output tokens/s ratio, ITL difference) under "structured_cost". A --preset checkpoint's
tokenizer spells tokens `t{i}`, from which no grammar can build JSON: add --text-tokenizer.

Comparisons in the same run, on the same prompts:
  --engine-only             LLMEngine in-process (no HTTP, no services), same arrivals and stats
  --compare-engine          HTTP and engine-only, both in one JSON with the difference
  --transformers-baseline   transformers `generate`, batch 32, left padding: output tokens / s

    python load_tests/bench_serving.py --preset llama3-8b --num-prompts 256 --input-len 1024 \
        --output-len 256 --compare-engine --transformers-baseline --out results/serving.json
    python load_tests/bench_serving.py --launch .cache/demo-model --num-prompts 8 --input-len 16 \
        --output-len 8 --out /tmp/s.json -- --device cpu
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.common import (  # noqa: E402
    PRESETS,
    add_layers_argument,
    checkpoint_matches,
    env_info,
    layer_overrides,
    write_json,
)
from load_tests.sse import InStreamError, sse_json  # noqa: E402
from voltserve.cli import command as voltserve_command

logger = logging.getLogger("bench_serving")

METRICS = ("ttft", "tpot", "itl", "e2el")


# ---------------------------------------------------------------------------------------------
# Workload

# The --response-format json_schema constraint: objects with an integer range, a bounded string,
# an enum and a boolean (the kinds of state a real schema has). minItems is set per run so the
# array cannot close before max_tokens: every request generates its full output_len, as in the
# plain run (ignore_eos alone does not keep a constrained request going once its grammar ends).
STRUCTURED_ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "ok"],
}


def structured_format(output_len: int) -> dict:
    # Each item takes at least ~10 tokens: output_len items cannot fit in output_len tokens.
    schema = {"type": "array", "items": STRUCTURED_ITEM, "minItems": max(1, output_len)}
    return {"type": "json_schema", "json_schema": {"name": "items", "schema": schema}}


@dataclass
class Prompt:
    token_ids: list[int]
    output_len: int
    text: str | None = None  # set for --prompt-type text


def load_tokenizer(model_dir: Path, serve_args: list[str]) -> Any:
    """The tokenizer the server uses: `voltserve serve --tokenizer` among serve_args, else the
    folder's, or the one a GGUF file's metadata holds."""
    from voltserve.services.launcher import build_parser
    from voltserve.services.renderer.render import load_tokenizer as server_tokenizer

    tokenizer = build_parser().parse_known_args(["--model", "-", *serve_args])[0].tokenizer
    return server_tokenizer(str(model_dir), tokenizer)


def model_vocab_size(model_dir: Path, serve_args: list[str]) -> int:
    """Ids every part of the stack accepts: the model's vocab, cut to the tokenizer's size (a
    GGUF file's vocabulary is its tokenizer's)."""
    from voltserve.shared.gguf_files import is_gguf

    if is_gguf(model_dir):
        try:
            return len(load_tokenizer(model_dir, serve_args))
        except Exception as e:
            raise SystemExit(
                f"no tokenizer for {model_dir} ({e}): give --vocab-size, or the server's "
                "tokenizer folder as --serve-args '--tokenizer DIR'"
            ) from e
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    try:
        vocab = min(vocab, len(load_tokenizer(model_dir, serve_args)))
    except Exception as e:  # a folder without a tokenizer: the config's vocab is all we know
        logger.warning("no tokenizer in %s (%s); using the config vocab %d", model_dir, e, vocab)
    return vocab


def hf_pretrained(model_dir: Path) -> tuple[str, dict[str, Any]]:
    """from_pretrained's path and keyword arguments for a folder or a GGUF file."""
    from voltserve.shared.gguf_files import gguf_files

    files = gguf_files(model_dir)
    if files is None:
        return str(model_dir), {}
    return str(files[0].parent), {"gguf_file": files[0].name}


def random_ids(rng: np.random.Generator, vocab_size: int, n: int) -> list[int]:
    """n random prompt ids. Ids below 16 are left out: small ids are special tokens in most
    vocabularies."""
    low = 16 if vocab_size > 64 else 0
    return rng.integers(low, vocab_size, size=n).tolist()


def build_dataset(args: argparse.Namespace, vocab_size: int) -> list[Prompt]:
    rng = np.random.default_rng(args.seed)

    def draw(n: int) -> list[int]:
        return random_ids(rng, vocab_size, n)

    if args.dataset == "random":
        prompts = [Prompt(draw(args.input_len), args.output_len) for _ in range(args.num_prompts)]
    elif args.dataset == "prefix":
        prefix = draw(args.prefix_len)
        prompts = [
            Prompt(prefix + draw(args.input_len), args.output_len) for _ in range(args.num_prompts)
        ]
    else:
        raise ValueError(f"unknown dataset {args.dataset!r}")
    for p in prompts:
        if p.token_ids and not 0 <= min(p.token_ids) <= max(p.token_ids) < vocab_size:
            raise RuntimeError(f"prompt token ids leave the vocabulary [0, {vocab_size})")
    return prompts


def build_warmup(args: argparse.Namespace, vocab_size: int) -> list[Prompt]:
    """The unmeasured warm-up prompts: fresh random ids as long as a measured prompt, sharing
    no prefix with any of them. (Warm-up on the first measured prompts would leave them in the
    prefix cache: their measured requests would skip most of the prefill.)"""
    rng = np.random.default_rng(args.seed + 1_000_003)
    length = args.input_len + (args.prefix_len if args.dataset == "prefix" else 0)
    out_len = min(args.output_len, 4)
    return [
        Prompt(random_ids(rng, vocab_size, length), out_len) for _ in range(max(0, args.num_warmup))
    ]


def add_text(prompts: list[Prompt], model_dir: Path, serve_args: list[str]) -> None:
    """Text prompts: decode the ids, then count the tokens the server will actually see."""
    tok = load_tokenizer(model_dir, serve_args)
    for p in prompts:
        p.text = tok.decode(p.token_ids)
        p.token_ids = tok(p.text, add_special_tokens=False).input_ids


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of a Poisson process at `rate` requests/s; rate inf: everything at 0."""
    if rate == float("inf"):
        return [0.0] * n
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


@dataclass
class RequestRecord:
    input_len: int
    output_len_expected: int
    start: float = 0.0  # seconds from the start of the run
    ttft: float | None = None
    end: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.end is not None

    @property
    def latency(self) -> float:
        return (self.end or 0.0) - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# ---------------------------------------------------------------------------------------------
# Metrics


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    ms = [v * 1e3 for v in values_s]
    out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else None
    out[f"median_{name}_ms"] = statistics.median(ms) if ms else None
    out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else None
    for p in percentiles:
        key = f"p{p:g}_{name}_ms"
        out[key] = float(np.percentile(ms, p)) if ms else None
    return out


def compute_metrics(
    records: list[RequestRecord], duration: float, percentiles: list[float]
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": total_out / duration if duration > 0 else None,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else None,
        "output_tokens_short": sum(1 for r in ok if r.output_tokens != r.output_len_expected),
    }
    m |= _stats("ttft", [r.ttft for r in ok], percentiles)
    m |= _stats("tpot", [t for r in ok if (t := r.tpot) is not None], percentiles)
    m |= _stats("itl", [x for r in ok for x in r.itl], percentiles)
    m |= _stats("e2el", [r.latency for r in ok], percentiles)
    errors = [r.error for r in records if r.error]
    if errors:
        m["errors"] = sorted(set(errors))[:10]
    return m


# ---------------------------------------------------------------------------------------------
# HTTP client


async def _send(
    session, url: str, payload: dict, headers: dict, rec: RequestRecord, t0: float
) -> None:
    import aiohttp

    start = time.perf_counter()
    rec.start = start - t0
    last = start
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                rec.error = f"HTTP {resp.status}: {body}"
                return
            usage_tokens = None
            chunks = 0
            async for obj in sse_json(resp):
                now = time.perf_counter()
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
            rec.end = time.perf_counter() - t0
            # usage counts tokens exactly; a chunk may carry several tokens (held-back text).
            rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
            if rec.ttft is None:
                rec.error = "stream ended without a token"
    except InStreamError as e:
        rec.error = str(e)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"


async def run_http(
    base_url: str,
    model: str,
    prompts: list[Prompt],
    arrivals: list[float],
    args: argparse.Namespace,
    warmup: list[Prompt],
    structured: bool = False,
) -> tuple[list[RequestRecord], float, float]:
    """The measured requests' records, the run's duration and its wall-clock start.
    structured: every request (warm-up too) carries the json_schema response_format."""
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    records = [RequestRecord(len(p.token_ids), p.output_len) for p in prompts]
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)

    def payload(p: Prompt) -> dict:
        body = {
            "model": model,
            "prompt": p.text if p.text is not None else p.token_ids,
            "max_tokens": p.output_len,
            "temperature": args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if structured:
            body["response_format"] = structured_format(p.output_len)
        return body

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        # Warm-up requests (not measured): first-request costs are not serving costs.
        warm = [RequestRecord(0, 0) for _ in warmup]
        warm_payloads = [payload(p) for p in warmup]
        now = time.perf_counter()
        await asyncio.gather(
            *(_send(session, url, w, headers, r, now) for w, r in zip(warm_payloads, warm))
        )
        if any(r.error for r in warm):
            raise RuntimeError(f"warm-up request failed: {next(r.error for r in warm if r.error)}")
        t0 = time.perf_counter()
        wall_start = time.time()  # the executor's step log is stamped in wall-clock time

        async def one(i: int) -> None:
            if sem is None:
                await _send(session, url, payload(prompts[i]), headers, records[i], t0)
            else:
                async with sem:
                    await _send(session, url, payload(prompts[i]), headers, records[i], t0)

        tasks = []
        for i, at in enumerate(arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return records, duration, wall_start


async def served_model_name(base_url: str, api_key: str | None) -> str:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as s:
        async with s.get(base_url.rstrip("/") + "/v1/models", headers=headers) as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]


# ---------------------------------------------------------------------------------------------
# Launching `voltserve serve`


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(
    model_dir: Path, serve_args: list[str], log_path: Path, timeout: float
) -> Iterator[str]:
    """Run `voltserve serve` in its own process group; yield its base URL once /health answers."""
    import urllib.error
    import urllib.request

    port = free_port()
    cmd = [*voltserve_command(), "serve", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *serve_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    logger.info("launching: %s (log: %s)", shlex.join(cmd), log_path)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"voltserve serve exited with code {proc.returncode} before it was ready; "
                    f"log tail:\n{_tail(log_path)}"
                )
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"voltserve serve not healthy after {timeout:.0f} s; log tail:\n{_tail(log_path)}"
                )
            time.sleep(0.1)
        logger.info("server ready at %s", base)
        yield base
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (it stops its services), then the whole group if anything lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            logger.error("voltserve serve did not stop in 60 s; killing its process group")
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group this script started
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


STEP_FIELDS = ("step", "ms", "added", "running", "waiting", "outputs")


def _log_lines(log_path: Path, *needles: str):
    """The server log's lines holding every needle, with their timestamp (s since the epoch);
    nothing when there is no log."""
    import calendar

    if not log_path.exists():
        return
    for line in log_path.read_text(errors="replace").splitlines():
        if not all(n in line for n in needles) or not line.startswith("ts="):
            continue
        try:
            ts, frac = line.split()[0].removeprefix("ts=").rstrip("Z").split(".")
            t = calendar.timegm(time.strptime(ts, "%Y-%m-%dT%H:%M:%S")) + int(frac) / 1e3
        except ValueError:
            continue
        yield t, line


def executor_steps(log_path: Path) -> list[dict[str, Any]]:
    """The executor's per-step DEBUG lines (`voltserve serve --log-level debug`) of a server log:
    ts (s, epoch), step, ms, added (requests that reached the engine before the step), running,
    waiting, outputs. Empty when the server did not log at debug level."""
    steps = []
    for t, line in _log_lines(log_path, " msg=step ", "logger=voltserve.services.executor"):
        kv = dict(f.split("=", 1) for f in line.split() if "=" in f)
        try:
            row: dict[str, Any] = {"ts": t}
            for k in STEP_FIELDS:
                row[k] = float(kv[k]) if k == "ms" else int(kv[k])
        except (KeyError, ValueError):
            continue
        steps.append(row)
    return steps


def scheduler_placements(log_path: Path) -> list[float]:
    """When the scheduler placed each request on an executor (its DEBUG "placed ... on ..."
    lines, s since the epoch): with the client's send times, where a burst waits before the
    engine. Empty when the server did not log at debug level."""
    needles = ('msg="placed ', "logger=voltserve.services.scheduler")
    return [t for t, _ in _log_lines(log_path, *needles)]


def placement_summary(placed: list[float]) -> dict[str, Any]:
    """How many requests the scheduler placed in a run and when (ms after its first request
    was sent): the first, the median and the last."""
    if not placed:
        return {"n": 0}
    placed = sorted(placed)
    return {
        "n": len(placed),
        "first_ms": 1e3 * placed[0],
        "median_ms": 1e3 * placed[len(placed) // 2],
        "last_ms": 1e3 * placed[-1],
    }


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------
# Engine in-process


def engine_config_from_serve_args(model_dir: Path, serve_args: list[str]):
    """The EngineConfig `voltserve serve` would build from the same flags (a fair comparison):
    the launcher's parser and the one builder (services/executor/engine_args.py)."""
    from voltserve.services.executor.engine_args import engine_config
    from voltserve.services.launcher import build_parser

    return engine_config(build_parser().parse_args(["--model", str(model_dir), *serve_args]))


def run_engine(
    model_dir: Path,
    serve_args: list[str],
    prompts: list[Prompt],
    arrivals: list[float],
    args: argparse.Namespace,
    warmup: list[Prompt],
) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    from voltserve.services.executor.engine import LLMEngine
    from voltserve.shared.sampling_params import SamplingParams

    config = engine_config_from_serve_args(model_dir, serve_args)
    t = time.perf_counter()
    engine = LLMEngine(config)
    info = {"init_s": time.perf_counter() - t, "config": asdict(config)}
    if warmup:  # the same warm-up the HTTP run gets
        engine.generate(
            [p.token_ids for p in warmup],
            SamplingParams(max_tokens=warmup[0].output_len, temperature=0.0, ignore_eos=True),
        )
    from voltserve.shared import startup

    startup.freeze_heap()  # as the executor process does after its start-up
    records = [RequestRecord(len(p.token_ids), p.output_len) for p in prompts]
    last_tok: dict[int, float] = {}
    pending = deque(range(len(prompts)))
    active: set[int] = set()
    limit = args.max_concurrency or len(prompts)
    t0 = time.perf_counter()
    while pending or active:
        now = time.perf_counter() - t0
        while pending and arrivals[pending[0]] <= now and len(active) < limit:
            i = pending.popleft()
            p = prompts[i]
            params = SamplingParams(
                max_tokens=p.output_len, temperature=args.temperature, ignore_eos=True
            )
            engine.add_request(f"r{i}", p.token_ids, params)
            records[i].start = time.perf_counter() - t0
            active.add(i)
        if not active:
            time.sleep(max(0.0, arrivals[pending[0]] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        now = time.perf_counter() - t0
        for o in outs:
            i = int(o.request_id[1:])
            rec = records[i]
            if o.new_token_ids:
                if rec.ttft is None:
                    rec.ttft = now - rec.start
                else:
                    rec.itl.append(now - last_tok[i])
                last_tok[i] = now
                rec.output_tokens += len(o.new_token_ids)
            if o.finished:
                rec.end = now
                active.discard(i)
                if o.finish_reason == "abort":
                    rec.error = "aborted"
    duration = time.perf_counter() - t0
    info["stats"] = asdict(engine.stats())
    return records, duration, info


# ---------------------------------------------------------------------------------------------
# transformers baseline


def run_transformers(
    model_dir: Path, device: str, dtype_spec: str, prompts: list[Prompt], args
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    sys_dtype = _torch_dtype(dtype_spec, device)
    t = time.perf_counter()
    path, kw = hf_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=sys_dtype, **kw).to(device).eval()
    load_s = time.perf_counter() - t
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else (pad if pad is not None else 0)
    prompts = prompts[: args.hf_max_prompts]
    bs = args.hf_batch_size

    def batch_tensors(batch: list[Prompt]):
        width = max(len(p.token_ids) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, p in enumerate(batch):  # left padding: every prompt ends at the last column
            ids[j, width - len(p.token_ids) :] = torch.tensor(p.token_ids)
            mask[j, width - len(p.token_ids) :] = 1
        return ids.to(device), mask.to(device)

    def generate(model, batch: list[Prompt]) -> int:
        ids, mask = batch_tensors(batch)
        n = batch[0].output_len
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,  # ignore_eos
            do_sample=False,
            pad_token_id=pad,
        )
        return (out.shape[1] - ids.shape[1]) * len(batch)

    with torch.inference_mode():
        generate(model, prompts[:1])  # warm up kernels and the allocator
        _sync(device)
        t = time.perf_counter()
        total_out = 0
        for k in range(0, len(prompts), bs):
            total_out += generate(model, prompts[k : k + bs])
        _sync(device)
        duration = time.perf_counter() - t
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    total_in = sum(len(p.token_ids) for p in prompts)
    return {
        "batch_size": bs,
        "num_prompts": len(prompts),
        "dtype": str(sys_dtype).removeprefix("torch."),
        "device": device,
        "load_s": load_s,
        "duration_s": duration,
        "total_output_tokens": total_out,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }


def _torch_dtype(spec: str, device: str):
    from load_tests.common import resolve_dtype

    return resolve_dtype(spec, device)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _device_of(serve_args: list[str]) -> tuple[str, str]:
    """(device, dtype) from the serve flags, 'auto' resolved the way the engine resolves it."""
    from load_tests.common import resolve_device

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    a, _ = p.parse_known_args(serve_args)
    return resolve_device(a.device), a.dtype


# ---------------------------------------------------------------------------------------------
# Plots and output


def write_plots(
    out: Path, runs: dict[str, list[RequestRecord]], percentiles: list[float]
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, metric in zip(axes.flat, METRICS):
        for name, recs in runs.items():
            ok = [r for r in recs if r.ok]
            vals = {
                "ttft": [r.ttft for r in ok],
                "tpot": [t for r in ok if (t := r.tpot) is not None],
                "itl": [x for r in ok for x in r.itl],
                "e2el": [r.latency for r in ok],
            }[metric]
            if not vals:
                continue
            v = np.sort(np.asarray(vals) * 1e3)
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
        ax.set_title(f"{metric.upper()} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of tokens")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    p = out.with_name(out.stem + "_latency_cdf.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))

    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 6), squeeze=False)
    for ax, (name, recs) in zip(axes[0], runs.items()):
        for i, r in enumerate(recs):
            if not r.ok:
                ax.plot([r.start, r.start], [i, i], "rx")
                continue
            first = r.start + r.ttft
            ax.plot([r.start, first], [i, i], color="tab:orange", lw=1.5)
            ax.plot([first, r.end], [i, i], color="tab:blue", lw=1.5)
        ax.set_title(f"{name}: per-request timeline (orange: waiting + prefill, blue: decode)")
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("request")
    fig.tight_layout()
    p = out.with_name(out.stem + "_timeline.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))
    return paths


def _records_json(records: list[RequestRecord]) -> list[dict[str, Any]]:
    return [
        {
            "input_len": r.input_len,
            "output_tokens": r.output_tokens,
            "start_s": r.start,
            "ttft_s": r.ttft,
            "end_s": r.end,
            "error": r.error,
        }
        for r in records
    ]


def print_summary(result: dict[str, Any]) -> None:
    print()
    rows = [(k, result[k]) for k in ("http", "http_structured", "engine") if k in result]
    if rows:
        print(
            f"{'':<8}{'req/s':>8}{'out tok/s':>11}{'tot tok/s':>11}"
            f"{'TTFT med':>10}{'TTFT p99':>10}{'TPOT med':>10}{'ITL med':>9}{'ITL p99':>9}{'fail':>6}"
        )
        for name, m in rows:

            def f(key: str, spec: str = ".1f", m: dict = m) -> str:
                v = m.get(key)
                return "-" if v is None else format(v, spec)

            print(
                f"{name.replace('http_structured', 'http+json'):<8}"
                f"{f('request_throughput', '.2f'):>8}{f('output_throughput'):>11}"
                f"{f('total_token_throughput'):>11}{f('median_ttft_ms'):>10}{f('p99_ttft_ms'):>10}"
                f"{f('median_tpot_ms', '.2f'):>10}{f('median_itl_ms', '.2f'):>9}"
                f"{f('p99_itl_ms', '.2f'):>9}{m.get('failed', 0):>6}"
            )
    if "services_overhead" in result:
        o = result["services_overhead"]
        print("services add: " + ", ".join(f"{k} {v:+.2f}" for k, v in o.items() if v is not None))
    if "structured_cost" in result:
        o = result["structured_cost"]
        print("json_schema: " + ", ".join(f"{k} {v:+.3f}" for k, v in o.items() if v is not None))
    if "transformers" in result:
        t = result["transformers"]
        print(f"transformers (batch {t['batch_size']}): {t['output_throughput']:.1f} output tok/s")
    for k, v in result.get("speedup_vs_transformers", {}).items():
        print(f"{k} / transformers output throughput: {v:.1f}x")
    for k, v in result.get("errors", {}).items():
        print(f"ERROR {k}: {v}")


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    trailing: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, trailing = argv[:k], argv[k + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    tgt = p.add_argument_group("target")
    tgt.add_argument("--base-url", default=None, help="a running server (default: launch one)")
    tgt.add_argument("--launch", metavar="MODEL_DIR", help="start `voltserve serve` on this model")
    tgt.add_argument("--preset", choices=sorted(PRESETS), help="random-weight checkpoint to launch")
    add_layers_argument(tgt)  # of the --preset checkpoint
    tgt.add_argument(
        "--model-dir",
        help="checkpoint folder (or GGUF file): for --preset (written if absent), "
        "--engine-only, --transformers-baseline and the vocabulary",
    )
    tgt.add_argument("--keep-model", action="store_true", help="keep a --preset temp checkpoint")
    tgt.add_argument("--serve-args", default="", help="extra flags for `voltserve serve`")
    tgt.add_argument("--launch-timeout", type=float, default=900.0)
    tgt.add_argument("--model", default=None, help="served model name (default: /v1/models)")
    tgt.add_argument("--api-key", default=None)
    wl = p.add_argument_group("workload")
    wl.add_argument("--dataset", choices=["random", "prefix"], default="random")
    wl.add_argument("--input-len", type=int, default=1024, help="random part of each prompt")
    wl.add_argument("--output-len", type=int, default=128)
    wl.add_argument("--prefix-len", type=int, default=256, help="shared prefix (dataset prefix)")
    wl.add_argument("--num-prompts", type=int, default=200)
    wl.add_argument("--prompt-type", choices=["ids", "text"], default="ids")
    wl.add_argument("--vocab-size", type=int, default=None, help="default: from the model")
    wl.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson req/s")
    wl.add_argument("--max-concurrency", type=int, default=None)
    wl.add_argument("--temperature", type=float, default=0.0)
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument("--num-warmup", type=int, default=2, help="unmeasured requests first")
    wl.add_argument("--request-timeout", type=float, default=600.0, help="per read, seconds")
    md = p.add_argument_group("modes")
    md.add_argument("--engine-only", action="store_true", help="LLMEngine in-process, no HTTP")
    md.add_argument("--compare-engine", action="store_true", help="HTTP and engine-only")
    md.add_argument("--transformers-baseline", action="store_true")
    md.add_argument(
        "--response-format",
        choices=["none", "json_schema"],
        default="none",
        help="json_schema: every HTTP request carries a JSON-schema constraint",
    )
    md.add_argument(
        "--text-tokenizer",
        action="store_true",
        help="serve a copy of the model folder with a tokenizer whose tokens spell text "
        "(load_tests/common.write_text_tokenizer): random checkpoints' t{i} tokens cannot "
        "spell JSON",
    )
    md.add_argument(
        "--compare-structured",
        action="store_true",
        help="HTTP twice against one server: plain, then with --response-format json_schema",
    )
    md.add_argument("--hf-batch-size", type=int, default=32)
    md.add_argument("--hf-max-prompts", type=int, default=128)
    out = p.add_argument_group("output")
    out.add_argument("--out", default=None, help="JSON file; plots are written next to it")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--percentiles", default="90,99")
    args = p.parse_args(argv)
    args.serve_args = shlex.split(args.serve_args) + trailing
    args.percentiles = [float(x) for x in args.percentiles.split(",") if x.strip()]
    if args.engine_only and args.compare_engine:
        p.error("--engine-only and --compare-engine exclude each other")
    if sum(x is not None for x in (args.base_url, args.launch, args.preset)) > 1:
        p.error("give one of --base-url, --launch, --preset")
    if args.layers is not None and not args.preset:
        p.error("--layers sets the layers of a --preset checkpoint")
    needs_http = not args.engine_only
    if needs_http and not (args.base_url or args.launch or args.preset):
        args.base_url = "http://127.0.0.1:8000"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("numba").setLevel(logging.WARNING)  # a line per CUDA module unload
    device, dtype_spec = _device_of(args.serve_args)
    result: dict[str, Any] = {
        "benchmark": "serving",
        "env": env_info(device),
        "args": vars(args) | {"request_rate": str(args.request_rate)},
        "errors": {},
    }
    tmp = None
    model_dir: Path | None = Path(args.model_dir) if args.model_dir else None
    if args.launch:
        model_dir = Path(args.launch)
    if args.preset:
        if model_dir is None:
            tmp = tempfile.mkdtemp(prefix=f"voltserve-{args.preset}-")
            model_dir = Path(tmp)
        overrides = layer_overrides(args.layers)
        if not checkpoint_matches(model_dir, args.preset, overrides):
            from load_tests.common import resolve_dtype, write_random_checkpoint

            logger.info("writing a random %s checkpoint to %s", args.preset, model_dir)
            t = time.perf_counter()
            write_random_checkpoint(
                model_dir,
                args.preset,
                device,
                resolve_dtype("float16", device),
                seed=args.seed,
                overrides=overrides,
            )
            result["checkpoint_write_s"] = time.perf_counter() - t
    if args.text_tokenizer:
        if model_dir is None:
            raise SystemExit("--text-tokenizer needs the model folder (--launch or --preset)")
        from voltserve.shared.gguf_files import is_gguf

        if is_gguf(model_dir):
            raise SystemExit("--text-tokenizer needs a Hugging Face folder, not a GGUF file")
        from load_tests.common import with_text_tokenizer

        model_dir = with_text_tokenizer(model_dir)
        logger.info("serving %s (the weights with a text-spelling tokenizer)", model_dir)
    if (args.engine_only or args.compare_engine or args.transformers_baseline) and not model_dir:
        raise SystemExit(
            "--engine-only/--compare-engine/--transformers-baseline need a model "
            "folder: --launch, --preset or --model-dir"
        )
    try:
        rc = _run(args, result, model_dir, device, dtype_spec)
    finally:
        if tmp and not args.keep_model:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return rc


def _run(args, result, model_dir: Path | None, device: str, dtype_spec: str) -> int:
    if args.vocab_size:
        vocab = args.vocab_size
    elif model_dir:
        vocab = model_vocab_size(model_dir, args.serve_args)
    else:
        raise SystemExit("against --base-url, give --vocab-size or --model-dir")
    prompts = build_dataset(args, vocab)
    warmup = build_warmup(args, vocab)
    if args.prompt_type == "text":
        if not model_dir:
            raise SystemExit("--prompt-type text needs the model folder (--model-dir)")
        add_text(prompts, model_dir, args.serve_args)
        add_text(warmup, model_dir, args.serve_args)
    arrivals = arrival_times(len(prompts), args.request_rate, args.seed)
    # --compare-structured: the constrained run gets prompts of its own (same lengths, other
    # ids): on the plain run's prompts every request would hit the prefix cache and the
    # comparison would measure the cache, not the constraint.
    alt_prompts = None
    if args.compare_structured:
        alt_prompts = build_dataset(
            argparse.Namespace(**{**vars(args), "seed": args.seed + 2_000_003}), vocab
        )
        if args.prompt_type == "text":
            add_text(alt_prompts, model_dir, args.serve_args)
    result["model_dir"] = str(model_dir) if model_dir else None
    result["dataset"] = {
        "name": args.dataset,
        "num_prompts": len(prompts),
        "vocab_size": vocab,
        "mean_input_len": statistics.fmean(len(p.token_ids) for p in prompts),
        "output_len": args.output_len,
        "prefix_len": args.prefix_len if args.dataset == "prefix" else 0,
        "request_rate": str(args.request_rate),
        "max_concurrency": args.max_concurrency,
        # The constrained run's prompts (--compare-structured) are drawn from this seed.
        "structured_seed": args.seed + 2_000_003 if args.compare_structured else None,
    }
    runs: dict[str, list[RequestRecord]] = {}

    # transformers first, in this process; its memory is freed before anything else starts.
    if args.transformers_baseline:
        logger.info("transformers baseline: batch %d", args.hf_batch_size)
        try:
            result["transformers"] = run_transformers(model_dir, device, dtype_spec, prompts, args)
        except Exception as e:
            traceback.print_exc()
            result["errors"]["transformers"] = f"{type(e).__name__}: {e}"

    if not args.engine_only:
        try:
            phases = _http_phase(args, model_dir, prompts, arrivals, warmup, alt_prompts)
            for key, (records, duration, name, steps, placed) in phases.items():
                result[key] = compute_metrics(records, duration, args.percentiles)
                result[key]["served_model_name"] = name
                result[key]["structured"] = key == "http_structured" or (
                    key == "http" and args.response_format == "json_schema"
                )
                # With `-- --log-level debug`: when the burst reached the engine, step by step.
                result[key]["executor_steps"] = steps
                result[key]["scheduler_placements"] = placement_summary(placed)
                result[key]["requests"] = _records_json(records)
                runs[key] = records
        except Exception as e:
            traceback.print_exc()
            result["errors"]["http"] = f"{type(e).__name__}: {e}"
        if "http" in result and "http_structured" in result:
            result["structured_cost"] = structured_cost(result["http"], result["http_structured"])

    # The engine runs last: the server is gone and transformers has freed its memory.
    if args.engine_only or args.compare_engine:
        logger.info("engine-only run (in-process LLMEngine)")
        try:
            records, duration, info = run_engine(
                model_dir, args.serve_args, prompts, arrivals, args, warmup
            )
            result["engine"] = compute_metrics(records, duration, args.percentiles)
            result["engine"]["engine"] = info
            result["engine"]["requests"] = _records_json(records)
            runs["engine"] = records
        except Exception as e:
            traceback.print_exc()
            result["errors"]["engine"] = f"{type(e).__name__}: {e}"

    if "http" in result and "engine" in result:
        h, g = result["http"], result["engine"]
        result["services_overhead"] = {
            k: (h[k] - g[k]) if h.get(k) is not None and g.get(k) is not None else None
            for k in (
                "median_ttft_ms",
                "mean_ttft_ms",
                "median_itl_ms",
                "mean_itl_ms",
                "p99_itl_ms",
                "median_tpot_ms",
            )
        }
    if "transformers" in result:
        hf = result["transformers"]["output_throughput"]
        result["speedup_vs_transformers"] = {
            k: result[k]["output_throughput"] / hf
            for k in ("http", "engine")
            if k in result and result[k].get("output_throughput")
        }
    if args.out and runs and not args.no_plots:
        try:
            result["plots"] = write_plots(Path(args.out), runs, args.percentiles)
        except Exception as e:
            traceback.print_exc()
            result["errors"]["plots"] = f"{type(e).__name__}: {e}"
    write_json(args.out, result)
    print_summary(result)
    failed = any(result.get(k, {}).get("failed") for k in ("http", "http_structured", "engine"))
    return 1 if result["errors"] or failed else 0


def structured_cost(plain: dict[str, Any], constrained: dict[str, Any]) -> dict[str, Any]:
    """The constrained run against the plain one: throughput ratio and latency differences."""

    def ratio(k: str) -> float | None:
        a, b = plain.get(k), constrained.get(k)
        return b / a if a and b is not None else None

    def diff(k: str) -> float | None:
        a, b = plain.get(k), constrained.get(k)
        return b - a if a is not None and b is not None else None

    return {
        "output_throughput_ratio": ratio("output_throughput"),
        "median_itl_ms_diff": diff("median_itl_ms"),
        "mean_itl_ms_diff": diff("mean_itl_ms"),
        "p99_itl_ms_diff": diff("p99_itl_ms"),
        "median_ttft_ms_diff": diff("median_ttft_ms"),
        "median_tpot_ms_diff": diff("median_tpot_ms"),
    }


def _http_phase(
    args, model_dir, prompts, arrivals, warmup, alt_prompts=None
) -> dict[str, tuple[list[RequestRecord], float, str, list[dict[str, Any]]]]:
    """The HTTP runs by result key ("http", and "http_structured" with --compare-structured,
    both against the same server): records, duration, model name and the launched server's
    executor steps (empty unless it logs at debug level, and against --base-url)."""
    kinds = [("http", args.response_format == "json_schema")]
    if args.compare_structured:
        kinds = [("http", False), ("http_structured", True)]
    # The prompts of each run (the constrained run of --compare-structured has its own).
    run_prompts = {"http": prompts, "http_structured": alt_prompts or prompts}
    if args.base_url:
        name = args.model or asyncio.run(served_model_name(args.base_url, args.api_key))
        out = {}
        for key, structured in kinds:
            records, duration, _ = asyncio.run(
                run_http(args.base_url, name, run_prompts[key], arrivals, args, warmup, structured)
            )
            out[key] = (records, duration, name, [])
        return out
    if args.out:
        log_path = Path(args.out).with_name(Path(args.out).stem + "_server.log")
    else:
        log_path = Path(tempfile.gettempdir()) / f"voltserve-bench-{os.getpid()}.log"
    runs = {}
    called: list[float] = []  # when each run (its warm-up first) began: splits the step log
    with launched_server(model_dir, args.serve_args, log_path, args.launch_timeout) as base:
        name = args.model or asyncio.run(served_model_name(base, args.api_key))
        for key, structured in kinds:
            called.append(time.time())
            logger.info(
                "HTTP run%s: %d requests to %s (model %s)",
                " (json_schema)" if structured else "",
                len(prompts),
                base,
                name,
            )
            runs[key] = asyncio.run(
                run_http(base, name, run_prompts[key], arrivals, args, warmup, structured)
            )
    all_steps = executor_steps(log_path)
    all_placed = scheduler_placements(log_path)
    out = {}
    bounds = [float("-inf"), *called[1:], float("inf")]
    for j, (key, _) in enumerate(kinds):
        records, duration, start = runs[key]
        steps = []
        for st in all_steps:
            if bounds[j] <= st["ts"] < bounds[j + 1]:
                st = dict(st)
                st["t"] = st.pop("ts") - start  # seconds since the first measured request
                steps.append(st)
        # After the run's first send: the warm-up requests were placed before it.
        placed = [t - start for t in all_placed if max(bounds[j], start) <= t < bounds[j + 1]]
        out[key] = (records, duration, name, steps, placed)
    return out


if __name__ == "__main__":
    sys.exit(main())
