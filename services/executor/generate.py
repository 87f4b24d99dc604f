"""`voltserve generate`: run the engine in-process on one or more prompts and print the text.

A quick way to try a checkpoint without the services:

    voltserve generate --model DIR --prompt "The capital of France is" --max-tokens 32
"""

from __future__ import annotations

import argparse
import sys
import time

from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="voltserve generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face model folder or GGUF file")
    ap.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for a batch)"
    )
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    ap.add_argument(
        "--quantization", default=None, choices=["awq", "gptq", "compressed-tensors", "gguf"]
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None, help="sampling seed of every prompt")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto | float16 | bfloat16 | float32")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-special-tokens", action="store_true", help="do not add BOS etc.")
    ap.add_argument("--stats", action="store_true", help="print timing and engine stats to stderr")
    return ap


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    # Heavy imports after argument parsing, so --help is instant.
    from voltserve.services.executor.engine import LLMEngine
    from voltserve.services.renderer.render import load_tokenizer

    tokenizer = load_tokenizer(args.model, args.tokenizer)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        enforce_eager=args.enforce_eager,
        seed=args.seed if args.seed is not None else 0,
        quantization=args.quantization,
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
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
    engine = LLMEngine(config)
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params)
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
