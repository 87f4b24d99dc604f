"""bench_serving and bench_decode given a GGUF file as the model: the vocabulary, the tokenizer
and the shape come from the file's metadata (no config.json beside it). CPU, a tiny Q8_0 llama
from tests/quant_checkpoints.py."""

from __future__ import annotations

import json

import pytest

from tests import quant_checkpoints as qc
from tests.load.scripts import run_main

VOCAB = 384  # tests/checkpoints.py tokenizer, which the GGUF's metadata carries


def _gguf():
    return qc.gguf_checkpoint("llama", lambda name: "Q8_0", "bench-Q8_0") / "model.gguf"


@pytest.mark.parametrize("tokenizer", ["metadata", "folder"])
def test_bench_serving_engine_only_reads_a_gguf_file(tmp_path, tokenizer) -> None:
    """The text prompts and the vocabulary come from the tokenizer the server would use: the
    file's metadata, or `voltserve serve --tokenizer DIR` given among the serve args."""
    out = tmp_path / "engine.json"
    serve = "--device cpu"
    if tokenizer == "folder":
        serve += f" --tokenizer {qc.float_checkpoint('llama')}"
    args = ["--engine-only", "--model-dir", str(_gguf()), "--prompt-type", "text"]
    args += ["--input-len", "12", "--output-len", "3", "--num-prompts", "3", "--num-warmup", "0"]
    run_main("bench_serving", [*args, "--no-plots", "--out", str(out), f"--serve-args={serve}"])
    d = json.loads(out.read_text())
    assert d["errors"] == {} and d["dataset"]["vocab_size"] == VOCAB
    e = d["engine"]
    assert e["completed"] == 3 and e["failed"] == 0 and e["total_output_tokens"] == 9


def test_bench_decode_takes_the_shape_of_a_gguf_file_over_the_preset(tmp_path) -> None:
    """The default preset is llama3-8b; the file is a 2-layer model of 384 tokens."""
    out = tmp_path / "decode.json"
    args = ["--model-dir", str(_gguf()), "--skip-transformers", "--device", "cpu"]
    args += ["--prompt-len", "8", "--output-len", "3", "--runs", "1", "--warmup", "0"]
    run_main("bench_decode", [*args, "--bandwidth-bytes", str(1 << 20), "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["errors"] == {} and d["model"]["format"] == "gguf"
    assert d["model"]["vocab_size"] == VOCAB
    cfg = json.loads((qc.float_checkpoint("llama") / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4  # fp32 on CPU
    assert d["model"]["kv_bytes_per_token"] == kv
    assert d["engine"]["decode_tok_s"] > 0


def test_bench_serving_names_the_way_out_when_a_gguf_has_no_usable_tokenizer(tmp_path) -> None:
    """A `--tokenizer` among the serve args is the one read (here a folder that is not there)."""
    args = ["--engine-only", "--model-dir", str(_gguf()), "--num-prompts", "1"]
    serve = f"--serve-args=--device cpu --tokenizer {tmp_path / 'missing'}"
    with pytest.raises(SystemExit, match="give --vocab-size"):
        run_main("bench_serving", [*args, "--out", str(tmp_path / "x.json"), serve])
