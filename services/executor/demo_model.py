"""`voltserve make-demo-model DIR`: a random-weight checkpoint with a real byte-level BPE tokenizer,
written in seconds, so the whole stack runs without downloading a model.

The tokenizer is trained here, with the `tokenizers` library, on the text below; the model is
built and saved by transformers (safetensors), so it loads with AutoTokenizer /
AutoModelForCausalLM as well as with voltserve's loader.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML: what Qwen2 instruct models use. A system message is optional.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model predicts the next token
from the tokens before it. Serving many requests at once needs continuous batching: each step
runs the decodes of running requests and chunks of new prompts together. The key and value
vectors of every token are kept in a paged cache of fixed-size blocks, so memory is not wasted
on padding. Volta GPUs have tensor cores for half precision matrix products but no bfloat16.
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the
capital of France. Write a short poem about the sea. The sea is wide and deep and blue.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
{"name": "voltserve", "version": 1, "ok": true, "items": [1, 2, 3]}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 2024 3.14159
Once upon a time there was a small robot who wanted to learn how to paint. Every morning it
looked at the sky and mixed the colours it saw. The other robots laughed, but the small robot
kept painting, and one day its paintings filled the whole city with light.
"""


_WORDS = """time person year way day thing man world life hand part child eye woman place work
week case point government company number group problem fact be have do say get make go know
take see come think look want give use find tell ask seem feel try leave call good new first
last long great little own other old right big high different small large next early young
important few public bad same able to of in for on with at by from up about into over after
beneath under above the and a that I it not he as you this but his they her she or an will my
one all would there their what so out if who which me when can like no just him people your
some could them than then now only its also back two how our well even because any these most
us server request token stream block cache batch kernel tensor memory model layer attention
python function return import class value string list dict error answer question music river
mountain forest garden window kitchen school teacher student doctor market village ocean""".split()


def _training_text() -> list[str]:
    # The short corpus plus word lists and numbers, so BPE finds enough merges for ~2k tokens.
    lines = [line for line in _CORPUS.splitlines() if line] * 4
    words = _WORDS
    for i in range(0, len(words), 7):
        chunk = words[i : i + 7]
        lines.append(" ".join(chunk).capitalize() + ".")
        lines.append(" ".join(w.upper() if len(w) < 4 else w.title() for w in chunk))
    lines += [" ".join(str(n) for n in range(k, k + 20)) for k in range(0, 2000, 20)]
    return lines * 2


def build_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE tokenizer (GPT-2 style) wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


SIZES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}


def make_config(arch: str, vocab_size: int, eos_ids: list[int], bos_id: int | None, **overrides):
    """A transformers config object for one of the supported architectures."""
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3_5Config,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )

    classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "qwen3_moe": Qwen3MoeConfig,
        "qwen2_moe": Qwen2MoeConfig,
        "mixtral": MixtralConfig,
        "qwen3_next": Qwen3NextConfig,
        "qwen3_5": Qwen3_5TextConfig,
        "qwen3_5_moe": Qwen3_5MoeTextConfig,
        "qwen3_5_vl": Qwen3_5Config,
    }
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(classes)}")
    kwargs = dict(SIZES["tiny"])
    kwargs.update(
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        bos_token_id=bos_id,
        tie_word_embeddings=arch == "qwen2",
    )
    kwargs.update(overrides)
    if arch == "qwen3_5_moe":
        kwargs.pop("intermediate_size")  # every layer is sparse: the config has no such key
    if arch == "qwen3_5_vl":
        # The vision-language layout: the text model's config in text_config, a token vision
        # tower (the text part is what voltserve serves).
        vision = kwargs.pop("vision_config", None) or dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2
        )
        tie = kwargs.pop("tie_word_embeddings")
        eos = kwargs.pop("eos_token_id")
        kwargs.pop("bos_token_id")
        vision.setdefault("out_hidden_size", kwargs["hidden_size"])
        return Qwen3_5Config(
            text_config=kwargs, vision_config=vision, tie_word_embeddings=tie, eos_token_id=eos
        )
    return classes[arch](**kwargs)


def write_checkpoint(
    out_dir: str | Path,
    arch: str = "qwen2",
    size: str = "tiny",
    vocab_size: int = 2048,
    seed: int = 0,
    tokenizer=None,
    shard_size: str | None = None,
    **config_overrides,
) -> Path:
    """Write tokenizer files, config.json, generation_config.json and safetensors weights."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer(vocab_size)
    tok.save_pretrained(out)
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    overrides = dict(SIZES[size])
    overrides.update(config_overrides)
    # Round the model's vocab up to a multiple of 64, as real checkpoints do.
    model_vocab = (len(tok) + 63) // 64 * 64
    config = make_config(arch, model_vocab, eos, None, **overrides)
    torch.manual_seed(seed)
    if arch == "qwen3_5_vl":
        from transformers import Qwen3_5ForConditionalGeneration

        model = Qwen3_5ForConditionalGeneration._from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Wider weights than the 0.02 default give peaked, less tie-prone next-token distributions.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # linears, embeddings, stacked MoE experts
                p.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.05)
            elif "bias" in name and "dt_bias" not in name:
                p.normal_(0.0, 0.02)
            else:  # norms
                p.uniform_(0.8, 1.2)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out, **kwargs)
    GenerationConfig(eos_token_id=eos, bos_token_id=None, do_sample=False).save_pretrained(out)
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="voltserve make-demo-model", description=__doc__)
    p.add_argument("dir", help="output folder")
    p.add_argument(
        "--arch",
        choices=[
            "qwen2",
            "llama",
            "mistral",
            "qwen3",
            "qwen3_moe",
            "qwen2_moe",
            "mixtral",
            "qwen3_next",
            "qwen3_5",
            "qwen3_5_moe",
            "qwen3_5_vl",
        ],
        default="qwen2",
    )
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = write_checkpoint(args.dir, args.arch, args.size, args.vocab_size, args.seed)
    cfg = json.loads((out / "config.json").read_text())
    print(
        f"wrote {args.arch} ({args.size}, vocab {cfg['vocab_size']}, "
        f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}) to {out}"
    )
