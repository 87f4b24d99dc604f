"""Speculative decoding on a random-weight checkpoint: batch-1 decode tok/s with n-gram and
with an oracle drafter of forced acceptance, and the verify step's cost against a decode step,
every figure against speculation off in the same run.

Random weights make acceptance a property of the weights, not of the method, so two figures do
not depend on it:
- the cost curve: the median engine step of a batch of B requests verifying k proposed tokens
  each (an oracle that proposes the target's own recorded greedy output, so every step
  verifies k) against the median plain decode step of the same batch (speculation off, CUDA
  graphs and the pipelined decode as a server runs it), k = --cost-ks, B = --batch-sizes;
- forced acceptance: the oracle's tokens each replaced by a wrong one with probability p
  (--corrupt), batch 1, k = --oracle-ks: tok/s, its speedup over speculation off, the measured
  acceptance and mean accepted length next to the intended ones (`intended_token_acceptance`
  1 - p; `expected_acceptance_rate` and `expected_mean_acceptance_length`, what corruption
  alone gives: sum_{j=1..k} (1 - p)^j accepted a step), and the ideal speedup (tokens per step
  / verify-step cost in decode steps).
Why the measured acceptance is not the intended one: the recording comes from speculation off,
whose one-row decode step rounds differently in fp16 from the verify step's k + 1 rows per
sequence, and a random model has near-tied logits, so the verified greedy path can part from
the recorded one; proposals after the parting are stale and rejected. The oracle keeps
proposing k tokens a step all the same (a stale step still verifies k rows, so the cost curve
holds), and each oracle figure is re-recorded: while a run's output parts from what it proposed
from, the run is repeated proposing that output (up to --oracle-passes runs; a repeat
reproduces its predecessor up to the parting, same proposals, corruption draws and row layout,
and proposes the target's own token there, so the parting moves later each pass). Each figure
reports `oracle_passes`, `output_equals_recording` and `first_parting` (the output position
where the last run left its recording, per request); with the recording followed to the end,
the measured acceptance differs from the expected one by the corruption draws only.
A draft model (`--draft-preset`: Llama-3.2-1B's shape with the target's vocabulary for
llama3-8b, else the target's own preset) runs batch 1 with its measured acceptance, step time
and the proposer's own time per step (`median_propose_ms`; its catch-up and k - 1 single-token
steps, `catch_up_in_graphs` and `draft_steps_in_graphs` saying whether they replayed graphs),
and so does an EAGLE-1 head of the target's shape (`--eagle-k`; random weights, written once
into --eagle-dir; default: a folder under the temporary directory named by the target folder
and the seed, so runs on different targets never share one; it is written to a side folder and
renamed into place, so concurrent runs never read a half-written head).
n-gram (`--ngram-k`, prompt_lookup_min 1, _max 4) runs on a copy-heavy prompt built from the
target itself: a random P, C the target's greedy continuation of P with speculation off, and
the prompt P + C + P (about --prompt-len tokens). The lookup of the output's last tokens finds
P's end earlier in the prompt and proposes what followed it there, C, as long as the output
keeps following C; whether the target continues P + C + P with C is up to its weights (a
trained model copies; random weights may not), so the figure reports the acceptance and
speedup as measured (against speculation off on the same prompt, `spec_off_ngram_prompt_batch1`)
and how many output tokens equal C's (`output_vs_continuation`).
Verify steps replay CUDA graphs captured for the server's k (spec/graphs.py), so each k of the
cost curve and of the forced-acceptance runs gets an engine of its own (k fixed per server);
every speculative figure reports how many verify steps (and draft-step and catch-up runs)
replayed graphs and how many ran eagerly (`graphs`, and `verify_in_graphs`: every verify step in
a graph).
A hybrid target's own MTP layer (`--mtp-k`; random weights in the published layout, added to
the target folder once by common.write_random_mtp) runs batch 1 the same way: the step cost with
its k forwards in it, acceptance as measured. Hybrid shapes at fewer layers: `--layers`, as
bench_decode; an AWQ folder is served as it is.
Parts: speculation off, n-gram, the oracle engine of each k, the draft model, the EAGLE head, MTP.
Each builds its engines as locals, so they are unreachable when it ends, and the collector and
the allocator's cache are run before the next; `released` records, per part, the engines still
alive after it (0 unless something holds one) and the CUDA memory still allocated. A part that
raises is recorded in `errors` (the exit status is then 1) and the following parts still run
(those needing speculation off's recordings fail with it); the JSON is written after each part.
Without --model-dir the checkpoint goes to a temporary folder, removed at the end.

    python load_tests/bench_spec.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b \
        --out results/spec_llama3-8b.json
    python load_tests/bench_spec.py --preset tiny --device cpu --output-len 16 --cost-ks 1,2
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

if not __package__:
    import _as_script  # noqa: F401  (load_tests.* importable; see _as_script.py)
from load_tests.common import (  # noqa: E402
    PRESETS,
    add_layers_argument,
    checkpoint_matches,
    dtype_name,
    env_info,
    layer_overrides,
    make_hf_config,
    quantized_checkpoint,
    resolve_device,
    resolve_dtype,
    synchronize,
    write_json,
    write_random_checkpoint,
    write_random_mtp,
)

logger = logging.getLogger("bench_spec")


def save(out: str | None, result: dict[str, Any]) -> None:
    """Write what is measured so far (a run cut by a time limit keeps its finished parts)."""
    if out:
        write_json(out, result)


# Every engine make_engine() built, weakly: after a part of the benchmark none may be left.
_ENGINES: list[weakref.ref] = []


def make_engine(model_dir: Path, device: str, dtype, args, spec: dict | None, prompt_len: int):
    from voltserve.services.executor.engine import LLMEngine
    from voltserve.services.executor.engine_args import engine_config

    B = max(args.batch_sizes)
    config = engine_config(
        model=str(model_dir),
        dtype=dtype_name(dtype),
        device=device,
        max_model_len=prompt_len + args.output_len + 16,
        max_num_seqs=max(B, 8),
        max_num_batched_tokens=max(2048, prompt_len),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_graph_batch_size=max(B, 1),
        cuda_graph_sizes=tuple(sorted({1, *args.batch_sizes})),
        speculative_config=spec,
        seed=0,
    )
    engine = LLMEngine(config)
    _ENGINES.append(weakref.ref(engine))
    return engine


def release() -> dict[str, Any]:
    """Collect what the finished part left (an engine's runner, weights, KV cache and graph
    pools are freed once nothing references them: reference cycles need the collector) and
    hand the allocator's cached blocks back. What is still alive afterwards, for the JSON."""
    gc.collect()
    _ENGINES[:] = [r for r in _ENGINES if r() is not None]
    for r in _ENGINES:
        logger.error(
            "an engine outlived its part of the benchmark; referrers: %s",
            [type(x).__name__ for x in gc.get_referrers(r())],
        )
    out: dict[str, Any] = {"engines_alive": len(_ENGINES)}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out["cuda_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        out["cuda_reserved_gib"] = torch.cuda.memory_reserved() / 2**30
    return out


def part(result: dict[str, Any], name: str, out: str | None, body: Callable[[], None]) -> bool:
    """Run one part of the benchmark. Its engines are locals of `body`, so they are unreachable
    once it returns or raises; an exception is recorded under result["errors"][name] (the
    traceback, which holds the frames that held the engine, is gone after the handler) and the
    next part runs. Every part's release is recorded under result["released"][name]."""
    ok = True
    try:
        body()
    except Exception as e:  # noqa: BLE001 (one part's failure must not lose the others)
        # The traceback as text: a log record that kept exc_info (a capturing handler keeps
        # its records) would keep the failed part's frames, and its engine, alive.
        logger.error("%s failed:\n%s", name, traceback.format_exc())
        result["errors"][name] = f"{type(e).__name__}: {e}"
        ok = False
    result["released"][name] = rel = release()
    if rel["engines_alive"]:
        result["errors"][f"{name}_release"] = f"{rel['engines_alive']} engine(s) still alive"
        ok = False
    save(out, result)
    return ok


def run(engine, device: str, prompts, output_len: int, tag: str) -> dict[str, Any]:
    """Run prompts to the end at once; per-step wall times (synchronized), tokens per request,
    and the decode phase of request 0 (first token to last)."""
    from voltserve.shared.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    stamps: list[float] = []
    steps: list[tuple[float, int, bool]] = []  # (ms, tokens emitted, every request past prefill)
    while engine.has_unfinished_requests():
        decoding = all(len(tokens[r]) > 0 for r in ids)
        t0 = time.perf_counter()
        outs = engine.step()
        synchronize(device)
        t1 = time.perf_counter()
        n = 0
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
            n += len(o.new_token_ids)
            if o.request_id == ids[0] and o.new_token_ids:
                stamps.append(t1)
        steps.append(((t1 - t0) * 1e3, n, decoding))
    out0 = tokens[ids[0]]
    decode_s = stamps[-1] - stamps[0] if len(stamps) > 1 else None
    # Steps with the whole batch decoding and producing at least one token per request.
    full = [ms for ms, n, dec in steps if dec and n >= len(ids)]
    return {
        "tokens": [tokens[r] for r in ids],
        "decode_tok_s": (len(out0) - 1) / decode_s if decode_s else None,
        "decode_steps": len([1 for _, _, dec in steps if dec]),
        "median_step_ms": statistics.median(full) if full else None,
    }


def spec_counters(engine) -> tuple[int, int, int]:
    s = engine.stats()
    return (
        s.spec_decode_num_drafts,
        s.spec_decode_num_draft_tokens,
        s.spec_decode_num_accepted_tokens,
    )


def graph_counts(engine) -> dict[str, int]:
    """The runner's counts of speculative steps in graphs and eager (spec/graphs.py)."""
    return dict(getattr(engine.runner, "spec_graph_counts", {}))


def graph_report(engine, before: dict[str, int]) -> dict[str, Any]:
    """Since `before`: verify steps (with proposals) replayed as graphs and run eagerly, and the
    same for runs of the proposer's single-token steps and of a draft model's catch-up; the
    captured verify sizes and rows."""
    now = graph_counts(engine)
    diff = {k: v - before.get(k, 0) for k, v in now.items()}
    vg = getattr(engine.runner, "verify_graphs", None)
    return {
        "graphs": {
            **diff,
            "verify_sizes": vg.sizes if vg is not None else [],
            "verify_rows_per_seq": vg.q if vg is not None else None,
        },
        "verify_in_graphs": diff.get("verify_graph", 0) > 0 and diff.get("verify_eager", 0) == 0,
    }


def with_proposer(engine, proposer, device, prompts, output_len, tag) -> dict[str, Any]:
    """run() with `proposer` on the engine: the speculation counters of this run, the steps in
    graphs, and the median wall time of the proposer's own calls (a draft model's forwards end
    in a copy back of their tokens, so the time includes its device work)."""
    engine.proposer = proposer
    d0, t0, a0 = spec_counters(engine)
    g0 = graph_counts(engine)
    propose_ms: list[float] = []
    inner = proposer.propose

    def timed(reqs):
        s = time.perf_counter()
        props = inner(reqs)
        propose_ms.append((time.perf_counter() - s) * 1e3)
        return props

    proposer.propose = timed
    try:
        r = run(engine, device, prompts, output_len, tag)
    finally:
        del proposer.propose
        engine.proposer = None
    r.update(graph_report(engine, g0))
    d1, t1, a1 = spec_counters(engine)
    drafts, draft_toks, acc = d1 - d0, t1 - t0, a1 - a0
    r["num_drafts"], r["num_draft_tokens"], r["num_accepted_tokens"] = drafts, draft_toks, acc
    r["acceptance_rate"] = acc / draft_toks if draft_toks else None
    r["mean_acceptance_length"] = 1 + acc / drafts if drafts else None
    r["proposed_per_draft"] = draft_toks / drafts if drafts else None
    r["median_propose_ms"] = statistics.median(propose_ms) if propose_ms else None
    return r


def oracle_run(
    engine, k: int, recorded: list[list[int]], p: float, args, device, vocab, prompts, tag
) -> dict[str, Any]:
    """The oracle proposer (spec/oracle.py, corruption p) over `prompts`, re-recorded: its
    continuations start as the speculation-off greedy outputs, and while a run's output parts
    from what it proposed from (the verify step's k + 1 rows per sequence round differently
    in fp16 from the one-row decode step, which moves near-tied argmaxes of random weights), the
    run is repeated proposing that run's output, up to --oracle-passes runs. A run reproduces
    the previous one up to where that one parted from its recording (same proposals, same
    corruption draws, same row layout), and there it proposes the token the target produced,
    so each pass moves the first parting later. The last run's figures are reported, with the
    passes it took and whether its output equals the recording it proposed from."""
    from voltserve.services.executor.spec.oracle import OracleProposer

    conts = [list(t) for t in recorded]
    passes = max(1, args.oracle_passes)
    for i in range(passes):
        t = f"{tag}r{i}"
        cont = {f"{t}-{j}": c for j, c in enumerate(conts)}
        r = with_proposer(
            engine,
            OracleProposer(k, cont, p, vocab, args.seed),
            device,
            prompts,
            args.output_len,
            t,
        )
        toks = r.pop("tokens")
        parted = [
            next((j for j, (a, b) in enumerate(zip(o, c)) if a != b), None)
            for o, c in zip(toks, conts)
        ]
        if all(x is None for x in parted) or i == passes - 1:
            break
        conts = toks
    r["oracle_passes"] = i + 1
    r["output_equals_recording"] = all(x is None for x in parted)
    # Output position where each request's output first differs from the proposals' source
    # (None: nowhere): proposals from there on were stale.
    r["first_parting"] = parted
    return r


def expected_acceptance(k: int, p: float) -> dict[str, float]:
    """Under corruption alone (every uncorrupted proposal equal to the target's token): a step
    of k proposals accepts the run before the first corrupted one, at least j tokens with
    probability (1 - p)^j, so E[accepted] = sum_{j=1..k} (1 - p)^j (a step cut short by the
    end of the output proposes fewer; ignored here)."""
    e = sum((1 - p) ** j for j in range(1, k + 1))
    return {
        "intended_token_acceptance": 1 - p,
        "expected_acceptance_rate": e / k,
        "expected_mean_acceptance_length": 1 + e,
    }


def matches(out: list[int], ref: list[int]) -> dict[str, int]:
    """How many of out's tokens equal ref's at the same output position, and the length of
    their common prefix."""
    prefix = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
    return {"equal": sum(a == b for a, b in zip(out, ref)), "common_prefix": prefix}


def write_random_eagle_head(d: Path, target_dir: Path, seed: int) -> Path:
    """An EAGLE-1 head (spec/eagle_head.py's layout) of the target's shape, random fp16 weights;
    kept when its config.json already matches the target's shape."""
    import json

    from safetensors.torch import save_file

    t = json.loads((target_dir / "config.json").read_text())
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "max_position_embeddings",
    )
    cfg = {k: t[k] for k in keys if t.get(k) is not None}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1)
    cfg["torch_dtype"] = "float16"

    def matches(folder: Path) -> bool:
        have = folder / "config.json"
        return (
            have.is_file()
            and json.loads(have.read_text()) == cfg
            and (folder / "head.safetensors").is_file()
        )

    if matches(d):
        return d
    # Written into a side folder, then renamed into place: a concurrent run sees either no
    # head or a whole one.
    d.parent.mkdir(parents=True, exist_ok=True)
    side = Path(tempfile.mkdtemp(prefix=f".{d.name}-", dir=d.parent))
    H, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).half()

    p = "layers.0."
    tensors = {
        "fc.weight": w(H, 2 * H),
        "fc.bias": torch.zeros(H, dtype=torch.float16),
        p + "self_attn.q_proj.weight": w(q, H),
        p + "self_attn.k_proj.weight": w(kv, H),
        p + "self_attn.v_proj.weight": w(kv, H),
        p + "self_attn.o_proj.weight": w(H, q),
        p + "mlp.gate_proj.weight": w(inter, H),
        p + "mlp.up_proj.weight": w(inter, H),
        p + "mlp.down_proj.weight": w(H, inter),
        p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.float16),
    }
    save_file(tensors, str(side / "head.safetensors"))
    (side / "config.json").write_text(json.dumps(cfg))
    if d.exists():
        shutil.rmtree(d, ignore_errors=True)  # a stale head of another shape
    try:
        os.rename(side, d)
    except OSError:
        shutil.rmtree(side, ignore_errors=True)  # another run renamed its head first
        if not matches(d):
            raise
    return d


def default_eagle_dir(preset: str, model_dir: Path, seed: int) -> Path:
    """A head folder per (target folder, seed): two runs on different targets never share it."""
    key = hashlib.sha1(f"{model_dir.resolve()}|{seed}".encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"voltserve-eagle-{preset}-{key}"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    p.add_argument(
        "--model-dir",
        help="reuse (or write once into) this checkpoint folder; a quantized folder (AWQ, "
        "make_awq_checkpoint.py) is served as it is",
    )
    add_layers_argument(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ngram-k", type=int, default=3, help="n-gram run (0: none)")
    p.add_argument("--oracle-ks", default="3,5")
    p.add_argument("--corrupt", default="0.1,0.3,0.5", help="oracle corruption probabilities")
    p.add_argument(
        "--oracle-passes",
        type=int,
        default=3,
        help="runs per oracle figure at most: each re-proposes the previous run's output",
    )
    p.add_argument("--cost-ks", default="1,2,3,4,5,6,7")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument(
        "--draft-preset",
        default="auto",
        help="draft model shape; auto: llama3.2-1b for llama3-8b, else the target's preset; "
        "'none' skips that run",
    )
    p.add_argument(
        "--draft-dir",
        default=None,
        help="default: beside a temporary checkpoint, else TMPDIR/voltserve-DRAFT_PRESET "
        "(-draft appended when it is the target's preset)",
    )
    p.add_argument("--draft-k", type=int, default=4)
    p.add_argument("--eagle-k", type=int, default=3, help="EAGLE head run (0: none)")
    p.add_argument(
        "--mtp-k",
        type=int,
        default=0,
        help="a hybrid target's own MTP layer (random weights, added to the folder once) "
        "proposing k tokens (0: none)",
    )
    p.add_argument(
        "--eagle-dir",
        default=None,
        help="default: beside a temporary checkpoint, else TMPDIR/voltserve-eagle-PRESET-KEY "
        "(KEY: a hash of the target folder and the seed)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON results file")
    a = p.parse_args(argv)
    a.oracle_ks = [int(x) for x in a.oracle_ks.split(",") if x]
    a.corrupt = [float(x) for x in a.corrupt.split(",") if x]
    a.cost_ks = [int(x) for x in a.cost_ks.split(",") if x]
    a.batch_sizes = [int(x) for x in a.batch_sizes.split(",") if x]
    if a.draft_preset == "auto":
        a.draft_preset = "llama3.2-1b" if a.preset == "llama3-8b" else a.preset
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("numba").setLevel(logging.WARNING)
    tmp_root = None
    if args.model_dir is None:
        tmp_root = Path(tempfile.mkdtemp(prefix=f"voltserve-{args.preset}-"))
    try:
        return _main(args, tmp_root)
    finally:
        if tmp_root is not None:
            shutil.rmtree(tmp_root, ignore_errors=True)


def _main(args, tmp_root: Path | None) -> int:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    overrides = layer_overrides(args.layers)
    hf_config = make_hf_config(args.preset, dtype, **overrides)
    vocab = hf_config.vocab_size
    model_dir = Path(args.model_dir) if tmp_root is None else tmp_root / "model"
    quantized = model_dir.is_dir() and quantized_checkpoint(model_dir)
    if not quantized and not checkpoint_matches(model_dir, args.preset, overrides):
        logger.info("writing a random %s checkpoint to %s", args.preset, model_dir)
        write_random_checkpoint(
            model_dir, args.preset, device, dtype, seed=args.seed, overrides=overrides
        )
    rng = np.random.default_rng(args.seed)
    B_max = max(args.batch_sizes)
    batch_prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(B_max)]
    # The n-gram workload: P, then (once its continuation C is recorded) P + C + P, of
    # --prompt-len tokens where the output length allows.
    plen = max(1, (args.prompt_len - args.output_len) // 2)
    P = rng.integers(3, vocab, plen).tolist()
    ngram_len = 2 * plen + args.output_len
    max_prompt = max(args.prompt_len, ngram_len)
    result: dict[str, Any] = {
        "benchmark": "spec_decode",
        "preset": args.preset,
        "device": device,
        "dtype": dtype_name(dtype),
        "env": env_info(device),
        "args": vars(args),
        "notes": "verify steps replay CUDA graphs captured for each engine's k (one engine per "
        "k of the cost curve and forced runs); plain decode steps replay CUDA graphs; "
        "'graphs' counts the speculative steps in graphs and eager; each part runs on its own "
        "engines, released before the next part ('released'); a part that fails is named in "
        "'errors' and the others still run",
        "errors": {},
        "released": {},
    }
    out = args.out

    def engine(spec: dict | None):
        return make_engine(model_dir, device, dtype, args, spec, max_prompt)

    def ngram_spec(k: int) -> dict:
        return {"method": "ngram", "num_speculative_tokens": k}

    # 1. Speculation off, as a server runs it (graphs, pipelined decode): the anchor, the
    # recorded greedy outputs the oracle proposes from, and the n-gram workload's continuation.
    recorded: dict[int, list[list[int]]] = {}
    ngram_work: dict[str, Any] = {}

    def spec_off() -> None:
        eng = engine(None)
        run(eng, device, [batch_prompts[0]], 8, "warm")
        off: dict[str, Any] = {}
        for B in args.batch_sizes:
            r = run(eng, device, batch_prompts[:B], args.output_len, f"off{B}")
            recorded[B] = r.pop("tokens")
            off[str(B)] = r
        result["spec_off"] = off
        if args.ngram_k <= 0:
            return
        (C,) = run(eng, device, [P], args.output_len, "offP")["tokens"]
        prompt = P + C + P
        r = run(eng, device, [prompt], args.output_len, "offPCP")
        (o,) = r.pop("tokens")
        r["output_vs_continuation"] = matches(o, C)
        result["spec_off_ngram_prompt_batch1"] = r
        ngram_work.update(C=C, prompt=prompt)

    part(result, "spec_off", out, spec_off)
    off = result.get("spec_off", {})
    base_tok_s = off.get("1", {}).get("decode_tok_s")
    base_step = {B: off.get(str(B), {}).get("median_step_ms") for B in args.batch_sizes}

    def speedup(r: dict[str, Any], base: float | None) -> float | None:
        return r["decode_tok_s"] / base if r.get("decode_tok_s") and base else None

    # 2. n-gram (prompt lookup) on a copy-heavy prompt: P + C + P, C the target's own greedy
    # continuation of P. The lookup of the output's last tokens finds P's end in the prompt and
    # proposes what follows it there, C, for as long as the output keeps equal to C.
    def ngram() -> None:
        from voltserve.services.executor.spec.ngram import NgramProposer

        C, prompt = ngram_work["C"], ngram_work["prompt"]
        eng = engine(ngram_spec(args.ngram_k))
        run(eng, device, [prompt], 8, "warm")
        eng.proposer = None
        in_engine_off = run(eng, device, [prompt], args.output_len, "off-in")
        in_engine_off.pop("tokens")
        result["spec_off_same_engine_batch1"] = in_engine_off
        ng = with_proposer(
            eng, NgramProposer(args.ngram_k, 1, 4), device, [prompt], args.output_len, "ngram"
        )
        (o,) = ng.pop("tokens")
        ng["workload"] = (
            f"prompt P + C + P ({len(P)} + {len(C)} + {len(P)} tokens, P random, C the "
            "target's greedy continuation of P with speculation off)"
        )
        ng["output_vs_continuation"] = matches(o, C)
        base = result.get("spec_off_ngram_prompt_batch1", {}).get("decode_tok_s")
        ng["speedup"] = speedup(ng, base)
        ng["speedup_same_engine"] = speedup(ng, in_engine_off["decode_tok_s"])
        result["ngram_batch1"] = ng

    if args.ngram_k > 0:
        part(result, "ngram", out, ngram)

    # 3. The oracle runs: one engine per k (the verify graphs are captured for the server's k).
    cost: dict[str, Any] = {}
    forced: dict[str, Any] = {}
    result["cost_curve"] = cost
    result["forced_acceptance_batch1"] = forced

    def oracle(k: int) -> None:
        eng = engine(ngram_spec(k))
        run(eng, device, [batch_prompts[0]], 8, "warm")
        for B in args.batch_sizes if k in args.cost_ks else ():
            r = oracle_run(
                eng, k, recorded[B], 0.0, args, device, vocab, batch_prompts[:B], f"cost{B}k{k}"
            )
            step = r["median_step_ms"]
            r["verify_over_decode_step"] = step / base_step[B] if step and base_step[B] else None
            cost[f"B{B}_k{k}"] = r
        for p in args.corrupt if k in args.oracle_ks else ():
            r = oracle_run(
                eng, k, recorded[1][:1], p, args, device, vocab, batch_prompts[:1], f"forced{k}p{p}"
            )
            r.update(expected_acceptance(k, p))
            r["speedup"] = speedup(r, base_tok_s)
            ratio = cost.get(f"B1_k{k}", {}).get("verify_over_decode_step")
            mal = r["mean_acceptance_length"]
            r["ideal_speedup"] = mal / ratio if mal and ratio else None
            forced[f"k{k}_p{p}"] = r

    for k in sorted(set(args.cost_ks) | set(args.oracle_ks)):
        part(result, f"oracle_k{k}", out, lambda k=k: oracle(k))

    # 4. A draft model of the same vocabulary (random weights: acceptance near zero, so the
    # figure to read is the step cost with the draft's forwards in it, next to the oracle's).
    def draft_model() -> None:
        if args.draft_dir:
            draft_dir = Path(args.draft_dir)
        elif tmp_root is not None:
            draft_dir = tmp_root / "draft"
        else:
            suffix = "-draft" if args.draft_preset == args.preset else ""
            draft_dir = Path(tempfile.gettempdir()) / f"voltserve-{args.draft_preset}{suffix}"
        if not checkpoint_matches(draft_dir, args.draft_preset):
            logger.info("writing a random %s checkpoint to %s", args.draft_preset, draft_dir)
            write_random_checkpoint(draft_dir, args.draft_preset, device, dtype, seed=args.seed + 1)
        spec = {
            "method": "draft_model",
            "model": str(draft_dir),
            "num_speculative_tokens": args.draft_k,
        }
        eng = engine(spec)
        prompt = batch_prompts[0]
        run(eng, device, [prompt], 8, "warm")
        dm = with_proposer(eng, eng.proposer, device, [prompt], args.output_len, "draft")
        dm["draft_steps_in_graphs"] = dm["graphs"].get("draft_graph", 0) > 0
        dm["catch_up_in_graphs"] = dm["graphs"].get("catchup_graph", 0) > 0
        dm.pop("tokens")
        dm["speedup"] = speedup(dm, base_tok_s)
        dm["draft_preset"] = args.draft_preset
        result["draft_model_batch1"] = dm

    if args.draft_preset != "none":
        part(result, "draft_model", out, draft_model)

    # 5. An EAGLE head of the target's shape (random weights: the step cost with the head's
    # catch-up and k - 1 steps in it, acceptance as measured).
    def eagle() -> None:
        if args.eagle_dir:
            eagle_dir = Path(args.eagle_dir)
        elif tmp_root is not None:
            eagle_dir = tmp_root / "eagle"
        else:
            eagle_dir = default_eagle_dir(args.preset, model_dir, args.seed)
        write_random_eagle_head(eagle_dir, model_dir, args.seed + 2)
        spec = {"method": "eagle", "model": str(eagle_dir), "num_speculative_tokens": args.eagle_k}
        eng = engine(spec)
        prompt = batch_prompts[0]
        run(eng, device, [prompt], 8, "warm")
        ea = with_proposer(eng, eng.proposer, device, [prompt], args.output_len, "eagle")
        ea["draft_steps_in_graphs"] = ea["graphs"].get("draft_graph", 0) > 0
        ea.pop("tokens")
        ea["speedup"] = speedup(ea, base_tok_s)
        result["eagle_batch1"] = ea

    if args.eagle_k > 0:
        part(result, "eagle", out, eagle)

    # 6. The target's own MTP layer (a hybrid model's; random weights written into the folder
    # once: the step cost with k MTP forwards in it, acceptance as measured).
    def mtp() -> None:
        write_random_mtp(model_dir, hf_config, device, dtype, args.seed + 3)
        eng = engine({"method": "mtp", "num_speculative_tokens": args.mtp_k})
        prompt = batch_prompts[0]
        run(eng, device, [prompt], 8, "warm")
        m = with_proposer(eng, eng.proposer, device, [prompt], args.output_len, "mtp")
        m.pop("tokens")
        m["speedup"] = speedup(m, base_tok_s)
        result["mtp_batch1"] = m

    if args.mtp_k > 0:
        part(result, "mtp", out, mtp)

    save(out, result)
    summary(args, result, base_tok_s)
    for name, err in result["errors"].items():
        print(f"error in {name}: {err}")
    return 1 if result["errors"] else 0


def summary(args, result: dict[str, Any], base_tok_s: float | None) -> None:
    def f(x, nd=2):
        return None if x is None else round(x, nd)

    print(f"spec off batch 1: {f(base_tok_s, 1)} tok/s")
    ng = result.get("ngram_batch1")
    if ng:
        print(
            f"n-gram k={args.ngram_k} on P + C + P: {f(ng['decode_tok_s'], 1)} tok/s, speedup "
            f"{f(ng['speedup'])}, drafts {ng['num_drafts']}, acceptance "
            f"{f(ng['acceptance_rate'])}, output tokens equal to C "
            f"{ng['output_vs_continuation']['equal']} of {args.output_len}"
        )
    for name, r in result.get("cost_curve", {}).items():
        print(
            f"cost {name}: step {f(r['median_step_ms'], 3)} ms, "
            f"x{f(r['verify_over_decode_step'], 3)}, verify in graphs {r['verify_in_graphs']}, "
            f"acceptance {f(r['acceptance_rate'])} ({r['oracle_passes']} passes)"
        )
    for name, r in result.get("forced_acceptance_batch1", {}).items():
        print(
            f"forced {name}: {f(r['decode_tok_s'], 1)} tok/s, speedup {f(r['speedup'])}, "
            f"acceptance {f(r['acceptance_rate'])} (expected {f(r['expected_acceptance_rate'])}), "
            f"accepted length {f(r['mean_acceptance_length'])}, ideal {f(r['ideal_speedup'])}"
        )
    for key, what in (
        ("draft_model_batch1", "draft model"),
        ("eagle_batch1", "eagle"),
        ("mtp_batch1", "mtp"),
    ):
        r = result.get(key)
        if r:
            print(
                f"{what}: {f(r['decode_tok_s'], 1)} tok/s, step {f(r['median_step_ms'], 3)} ms "
                f"(proposer {f(r['median_propose_ms'], 3)} ms), acceptance "
                f"{f(r['acceptance_rate'])}, graphs {r['graphs']}"
            )


if __name__ == "__main__":
    sys.exit(main())
