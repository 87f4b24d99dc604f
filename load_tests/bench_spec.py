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
  mean accepted length, and the ideal speedup (tokens per step / verify-step cost in decode
  steps).
A draft model (`--draft-preset`, default Llama-3.2-1B's shape with the target's vocabulary) runs
batch 1 with its measured acceptance and step time, and so does an EAGLE-1 head of the target's
shape (`--eagle-k`; random weights, written once into --eagle-dir; default: a folder under the
temporary directory named by the target folder and the seed, so runs on different targets never
share one; it is written to a side folder and renamed into place, so concurrent runs never read
a half-written head).
n-gram (`--ngram-k`) runs on a copy-heavy prompt (a phrase repeated to --prompt-len): its
acceptance is whatever the random model's output repeats of it, reported as measured.
Verify steps replay CUDA graphs captured for the server's k (spec/graphs.py), so each k of the
cost curve and of the forced-acceptance runs gets an engine of its own (k fixed per server);
every speculative figure reports how many verify steps (and draft-step runs) replayed graphs and
how many ran eagerly (`graphs`, and `verify_in_graphs`: every verify step in a graph).
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
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import (  # noqa: E402
    PRESETS,
    checkpoint_matches,
    dtype_name,
    env_info,
    make_hf_config,
    resolve_device,
    resolve_dtype,
    synchronize,
    write_json,
    write_random_checkpoint,
)

logger = logging.getLogger("bench_spec")


def save(out: str | None, result: dict[str, Any]) -> None:
    """Write what is measured so far (a run cut by a time limit keeps its finished parts)."""
    if out:
        write_json(out, result)


def make_engine(model_dir: Path, device: str, dtype, args, spec: dict | None):
    from voltserve.services.executor.engine import LLMEngine
    from voltserve.shared.config import EngineConfig

    B = max(args.batch_sizes)
    config = EngineConfig(
        model=str(model_dir),
        dtype=dtype_name(dtype),
        device=device,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_seqs=max(B, 8),
        max_num_batched_tokens=max(2048, args.prompt_len),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_graph_batch_size=max(B, 1),
        cuda_graph_sizes=tuple(sorted({1, *args.batch_sizes})),
        speculative_config=spec,
        seed=0,
    )
    return LLMEngine(config)


def release(engine) -> None:
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    same for runs of the proposer's single-token steps; the captured verify sizes and rows."""
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
    engine.proposer = proposer
    d0, t0, a0 = spec_counters(engine)
    g0 = graph_counts(engine)
    r = run(engine, device, prompts, output_len, tag)
    r.update(graph_report(engine, g0))
    d1, t1, a1 = spec_counters(engine)
    drafts, draft_toks, acc = d1 - d0, t1 - t0, a1 - a0
    r["num_drafts"], r["num_draft_tokens"], r["num_accepted_tokens"] = drafts, draft_toks, acc
    r["acceptance_rate"] = acc / draft_toks if draft_toks else None
    r["mean_acceptance_length"] = 1 + acc / drafts if drafts else None
    return r


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
    p.add_argument("--model-dir", help="reuse (or write once into) this checkpoint folder")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--phrase-len", type=int, default=48, help="the repeated phrase's length")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ngram-k", type=int, default=3)
    p.add_argument("--oracle-ks", default="3,5")
    p.add_argument("--corrupt", default="0.1,0.3,0.5", help="oracle corruption probabilities")
    p.add_argument("--cost-ks", default="1,2,3,4,5,6,7")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument(
        "--draft-preset", default="llama3.2-1b", help="draft model shape; 'none' skips that run"
    )
    p.add_argument("--draft-dir", default="/tmp/voltserve-llama3.2-1b")
    p.add_argument("--draft-k", type=int, default=4)
    p.add_argument("--eagle-k", type=int, default=3, help="EAGLE head run (0: none)")
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
    from voltserve.services.executor.spec.ngram import NgramProposer
    from voltserve.services.executor.spec.oracle import OracleProposer

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    vocab = make_hf_config(args.preset, dtype).vocab_size
    model_dir = Path(args.model_dir) if tmp_root is None else tmp_root / "model"
    if not checkpoint_matches(model_dir, args.preset):
        logger.info("writing a random %s checkpoint to %s", args.preset, model_dir)
        write_random_checkpoint(model_dir, args.preset, device, dtype, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    phrase = rng.integers(3, vocab, args.phrase_len).tolist()
    copy_prompt = (phrase * (args.prompt_len // len(phrase) + 1))[: args.prompt_len]
    B_max = max(args.batch_sizes)
    batch_prompts = [copy_prompt] + [
        rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(B_max - 1)
    ]
    result: dict[str, Any] = {
        "benchmark": "spec_decode",
        "preset": args.preset,
        "device": device,
        "dtype": dtype_name(dtype),
        "env": env_info(device),
        "args": vars(args),
        "notes": "verify steps replay CUDA graphs captured for each engine's k (one engine per "
        "k of the cost curve and forced runs); plain decode steps replay CUDA graphs; "
        "'graphs' counts the speculative steps in graphs and eager",
    }

    # 1. Speculation off, as a server runs it (graphs, pipelined decode): the anchor, and the
    # recorded greedy outputs the oracle proposes from.
    eng = make_engine(model_dir, device, dtype, args, None)
    run(eng, device, [copy_prompt], 8, "warm")
    off: dict[str, Any] = {}
    recorded: dict[int, list[list[int]]] = {}
    for B in args.batch_sizes:
        r = run(eng, device, batch_prompts[:B], args.output_len, f"off{B}")
        recorded[B] = r.pop("tokens")
        off[str(B)] = r
    result["spec_off"] = off
    save(args.out, result)
    release(eng)
    eng = None

    # 2. The speculative engine (no pipelined decode).
    eng = make_engine(
        model_dir, device, dtype, args, {"method": "ngram", "num_speculative_tokens": args.ngram_k}
    )
    run(eng, device, [copy_prompt], 8, "warm")
    eng.proposer = None
    in_engine_off = run(eng, device, [copy_prompt], args.output_len, "off-in")
    in_engine_off.pop("tokens")
    result["spec_off_same_engine_batch1"] = in_engine_off
    base_tok_s = off["1"]["decode_tok_s"]
    base_step = {B: off[str(B)]["median_step_ms"] for B in args.batch_sizes}

    ng = with_proposer(
        eng,
        NgramProposer(args.ngram_k, 1, 4),
        device,
        [copy_prompt],
        args.output_len,
        "ngram",
    )
    ng.pop("tokens")
    ng["speedup"] = ng["decode_tok_s"] / base_tok_s if base_tok_s else None
    result["ngram_batch1"] = ng
    save(args.out, result)

    release(eng)
    eng = None

    # The oracle runs: one engine per k (the verify graphs are captured for the server's k).
    cost: dict[str, Any] = {}
    forced: dict[str, Any] = {}
    for k in sorted(set(args.cost_ks) | set(args.oracle_ks)):
        eng = make_engine(
            model_dir, device, dtype, args, {"method": "ngram", "num_speculative_tokens": k}
        )
        run(eng, device, [copy_prompt], 8, "warm")
        for B in args.batch_sizes if k in args.cost_ks else ():
            tag = f"cost{B}k{k}"
            cont = {f"{tag}-{i}": t for i, t in enumerate(recorded[B])}
            r = with_proposer(
                eng,
                OracleProposer(k, cont, 0.0, vocab),
                device,
                batch_prompts[:B],
                args.output_len,
                tag,
            )
            r.pop("tokens")
            step = r["median_step_ms"]
            r["verify_over_decode_step"] = step / base_step[B] if step and base_step[B] else None
            cost[f"B{B}_k{k}"] = r
        for p in args.corrupt if k in args.oracle_ks else ():
            tag = f"forced{k}p{p}"
            cont = {f"{tag}-0": recorded[1][0]}
            r = with_proposer(
                eng,
                OracleProposer(k, cont, p, vocab, args.seed),
                device,
                [copy_prompt],
                args.output_len,
                tag,
            )
            r.pop("tokens")
            r["speedup"] = r["decode_tok_s"] / base_tok_s if base_tok_s else None
            ratio = cost.get(f"B1_k{k}", {}).get("verify_over_decode_step")
            mal = r["mean_acceptance_length"]
            r["ideal_speedup"] = mal / ratio if mal and ratio else None
            forced[f"k{k}_p{p}"] = r
        release(eng)
        eng = None
        result["cost_curve"] = cost
        result["forced_acceptance_batch1"] = forced
        save(args.out, result)

    # 3. A draft model of the same vocabulary (random weights: acceptance near zero, so the
    # figure to read is the step cost with the draft's k forwards in it, next to the oracle's).
    if args.draft_preset != "none":
        draft_dir = Path(args.draft_dir)
        if not checkpoint_matches(draft_dir, args.draft_preset):
            logger.info("writing a random %s checkpoint to %s", args.draft_preset, draft_dir)
            write_random_checkpoint(draft_dir, args.draft_preset, device, dtype, seed=args.seed + 1)
        spec = {
            "method": "draft_model",
            "model": str(draft_dir),
            "num_speculative_tokens": args.draft_k,
        }
        eng = make_engine(model_dir, device, dtype, args, spec)
        run(eng, device, [copy_prompt], 8, "warm")
        dm = with_proposer(eng, eng.proposer, device, [copy_prompt], args.output_len, "draft")
        dm["draft_steps_in_graphs"] = dm["graphs"].get("draft_graph", 0) > 0
        dm.pop("tokens")
        dm["speedup"] = dm["decode_tok_s"] / base_tok_s if base_tok_s else None
        dm["draft_preset"] = args.draft_preset
        result["draft_model_batch1"] = dm
        save(args.out, result)
        release(eng)

    # 4. An EAGLE head of the target's shape (random weights: the step cost with the head's
    # catch-up and k - 1 steps in it, acceptance as measured).
    if args.eagle_k > 0:
        if args.eagle_dir:
            eagle_dir = Path(args.eagle_dir)
        elif tmp_root is not None:
            eagle_dir = tmp_root / "eagle"
        else:
            eagle_dir = default_eagle_dir(args.preset, model_dir, args.seed)
        write_random_eagle_head(eagle_dir, model_dir, args.seed + 2)
        spec = {"method": "eagle", "model": str(eagle_dir), "num_speculative_tokens": args.eagle_k}
        eng = make_engine(model_dir, device, dtype, args, spec)
        run(eng, device, [copy_prompt], 8, "warm")
        ea = with_proposer(eng, eng.proposer, device, [copy_prompt], args.output_len, "eagle")
        ea["draft_steps_in_graphs"] = ea["graphs"].get("draft_graph", 0) > 0
        ea.pop("tokens")
        ea["speedup"] = ea["decode_tok_s"] / base_tok_s if base_tok_s else None
        result["eagle_batch1"] = ea
        release(eng)

    write_json(args.out, result)
    print(f"spec off batch 1: {base_tok_s and round(base_tok_s, 1)} tok/s")
    print(
        f"n-gram k={args.ngram_k}: {ng['decode_tok_s'] and round(ng['decode_tok_s'], 1)} tok/s, "
        f"acceptance {ng['acceptance_rate']}, verify in graphs {ng['verify_in_graphs']}"
    )
    for name, r in cost.items():
        print(
            f"cost {name}: step {r['median_step_ms']} ms, x{r['verify_over_decode_step']}, "
            f"verify in graphs {r['verify_in_graphs']}"
        )
    if "draft_model_batch1" in result:
        dm = result["draft_model_batch1"]
        print(
            f"draft model k={args.draft_k}: {dm['decode_tok_s']} tok/s, step "
            f"{dm['median_step_ms']} ms, acceptance {dm['acceptance_rate']}, verify in graphs "
            f"{dm['verify_in_graphs']}, draft steps in graphs {dm['draft_steps_in_graphs']}"
        )
    if "eagle_batch1" in result:
        ea = result["eagle_batch1"]
        print(
            f"eagle k={args.eagle_k}: {ea['decode_tok_s']} tok/s, step "
            f"{ea['median_step_ms']} ms, acceptance {ea['acceptance_rate']}, verify in graphs "
            f"{ea['verify_in_graphs']}, head steps in graphs {ea['draft_steps_in_graphs']}"
        )
    for name, r in forced.items():
        print(
            f"forced {name}: {r['decode_tok_s']} tok/s, speedup {r['speedup']}, "
            f"accepted length {r['mean_acceptance_length']}, ideal {r['ideal_speedup']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
