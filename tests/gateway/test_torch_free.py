"""The gateway loads its tokenizer without torch (shared/torch_free.py): the torch-free tokenizer
encodes, decodes and renders chat templates exactly as transformers' with torch does, torch stays
importable for what needs it (xgrammar builds a grammar afterwards), and a GGUF model keeps torch
(transformers reads its tokenizer through it)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from transformers import AutoTokenizer

from tests.checkpoints import checkpoint

PROBE = """
import json, sys
from voltserve.shared.torch_free import keep_torch_out
model, text, messages = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
keep_torch_out(model)
from voltserve.services.renderer.render import load_tokenizer
tok = load_tokenizer(model)
ids = tok.encode(text)
print(json.dumps({
    "ids": ids,
    "text": tok.decode(ids),
    "chat": tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
    "torch": sys.modules.get("torch") is not None,
}))
from voltserve.services.renderer.render import check_constraint
check_constraint({"type": "json", "value": '{"type": "object"}'})  # xgrammar imports torch now
print(json.dumps({"grammar_torch": sys.modules.get("torch") is not None}))
"""


def test_tokenizer_without_torch_equals_transformers_with_torch(rng: random.Random, tmp_path):
    model = checkpoint("qwen2")
    pieces = ["sun", "dog", "é", "中文", "x{y}", "'q'", " ", "\n"]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
    messages = [{"role": "system", "content": text}, {"role": "user", "content": text[::-1]}]
    proc = subprocess.run(
        [sys.executable, "-P", "-c", PROBE, str(model), text, json.dumps(messages)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "PyTorch was not found" not in proc.stderr
    lines = proc.stdout.splitlines()
    got, later = json.loads(lines[0]), json.loads(lines[1])
    assert got["torch"] is False  # transformers took its torch-free path
    assert later["grammar_torch"] is True  # and torch stays importable for what needs it
    want = AutoTokenizer.from_pretrained(model)  # this process has torch
    assert got["ids"] == want.encode(text)
    assert got["text"] == want.decode(want.encode(text))
    assert got["chat"] == want.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_a_gguf_model_keeps_torch(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # only its name is read to tell a GGUF path
    code = (
        "import sys\n"
        "from voltserve.shared.torch_free import keep_torch_out\n"
        f"keep_torch_out({str(gguf)!r})\n"
        "import torch\n"
        "print(torch.__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "torch", proc.stderr
