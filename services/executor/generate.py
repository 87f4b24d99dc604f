"""`voltserve generate`: run the engine in-process on one or more prompts and print the text.

A quick way to try a checkpoint without the services:

    voltserve generate --model DIR --prompt "The capital of France is" --max-tokens 32
"""

from __future__ import annotations

import argparse
import sys
import time

from voltserve.services.executor.engine_args import add_engine_flags, engine_config
from voltserve.shared.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="voltserve generate", description=__doc__.splitlines()[0])
    add_engine_flags(ap)
    ap.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for a batch)"
    )
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--no-special-tokens", action="store_true", help="do not add BOS etc.")
    ap.add_argument("--stats", action="store_true", help="print timing and engine stats to stderr")
    return ap


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    # Heavy imports after argument parsing, so --help is instant.
    from voltserve.services.executor.engine import LLMEngine
    from voltserve.services.renderer.render import load_tokenizer

    tokenizer = load_tokenizer(args.model, args.tokenizer)
    # Every prompt's seed is drawn from --seed by the engine. Validated here, once: a bad
    # parameter is a usage error before the model loads.
    params = SamplingParams(
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
    )
    try:
        params.validate()
    except ValueError as e:
        sys.exit(f"voltserve generate: {e}")
    prompts = [
        tokenizer(p, add_special_tokens=not args.no_special_tokens)["input_ids"]
        for p in args.prompt
    ]
    engine = LLMEngine(engine_config(args))
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params, validated=True)
    elapsed = time.perf_counter() - t0
    for i, (text, ids) in enumerate(zip(args.prompt, outputs)):
        if len(outputs) > 1:
            print(f"--- [{i}] {text!r}")
        print(tokenizer.decode(ids, skip_special_tokens=True), flush=True)
    if args.stats:
        n = sum(len(o) for o in outputs)
        print(
            f"{n} tokens in {elapsed:.2f} s ({n / max(elapsed, 1e-9):.1f} tok/s); {engine.stats()}",
            file=sys.stderr,
        )
