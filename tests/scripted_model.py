"""A tiny Qwen2 checkpoint whose weights make it say scripted replies, for testing what the
gateway does with a model's text (tool calls, reasoning) through the real services.

Each reply piece is one added token. The weights turn the model into a bigram table: every
layer's output projections are zero, so the last hidden state is the token's own embedding;
the pieces' embeddings are one-hot, and the lm_head row of each piece's successor reads that
coordinate. Inside a reply the successor wins by 1000 logits; the first piece, chosen by the
prompt's last token (the "\\n" after "<|im_start|>assistant"), wins by only 50, so a logit_bias
of 100 on another reply's first piece picks that reply (and is too small to matter later).

The tokenizer carries a Qwen2.5-style chat template with tools, tool calls and tool results
(the conventions of Qwen's own template, written here from its documented format).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

REPLIES = {
    # The default reply (no bias): a hermes tool call with text before it.
    "tool": [
        "Let me check.",
        "<tool_call>",
        '\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n',
        "</tool_call>",
    ],
    "think": ["<think>", "\nThe user greets me.\n", "</think>", "\n\nHello there!"],
    "answer": ["It is sunny in Paris."],
}
EOS = "<|im_end|>"
FIRST_MARGIN, NEXT_MARGIN = 50.0, 1000.0

QWEN_TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


@functools.cache
def scripted_checkpoint(root: str, replies: tuple[tuple[str, ...], ...] | None = None) -> Path:
    """The checkpoint in root. replies: the reply table (default REPLIES); the first reply is
    the one said without a bias. A piece may appear in one reply only."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM
    from voltserve.services.executor.demo_model import build_tokenizer, write_checkpoint

    tok = build_tokenizer(vocab_size=384)
    table = [list(r) for r in replies] if replies else list(REPLIES.values())
    pieces = sorted({p for reply in table for p in reply})
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    out = Path(root) / "scripted-qwen2"
    write_checkpoint(
        out,
        arch="qwen2",
        tokenizer=tok,
        tie_word_embeddings=False,
        num_hidden_layers=1,
        max_position_embeddings=4096,
    )
    ids = {p: tok.convert_tokens_to_ids(p) for p in pieces}
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1, newline
    eos = tok.convert_tokens_to_ids(EOS)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    H = model.config.hidden_size
    sources = [newline[0]] + [ids[p] for p in pieces]
    assert len(sources) <= H
    coord = {t: k for k, t in enumerate(sources)}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for norm in [model.model.norm] + [
            m
            for la in model.model.layers
            for m in (la.input_layernorm, la.post_attention_layernorm)
        ]:
            norm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight
        emb[:, : len(sources)] = 0.0  # other tokens read nothing of the table
        for t, k in coord.items():
            emb[t].zero_()
            emb[t, k] = 1.0
        W = model.lm_head.weight
        W.zero_()
        scale = 1.0 / H**0.5  # RMSNorm turns a one-hot row into sqrt(H) on its coordinate
        W[ids[table[0][0]], coord[newline[0]]] = FIRST_MARGIN * scale
        for reply in table:
            seq = [ids[p] for p in reply] + [eos]
            for a, b in zip(seq, seq[1:]):
                W[b, coord[a]] = NEXT_MARGIN * scale
    model.save_pretrained(out)
    (out / "scripted.json").write_text(json.dumps({"ids": ids, "eos": eos}))
    return out


def piece_id(path: Path, piece: str) -> int:
    return json.loads((path / "scripted.json").read_text())["ids"][piece]
