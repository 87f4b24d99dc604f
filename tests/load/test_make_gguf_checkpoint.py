"""load_tests/make_gguf_checkpoint.py and its torch K-quant packers (load_tests/gguf_pack.py):
the blocks decode, by the gguf package's own dequantizer, to the input within the format's
rounding error, and are byte-identical to the tests' numpy packers (tests/quant_checkpoints.py);
the script's file equals, tensor for tensor, what the tests' GGUF writer writes with the same
Q4_K_M rule, and voltserve's loader reads it back as gguf dequantizes it; bench_decode serves a
GGUF file with its floor counted from the bytes the file stores. CPU only, seconds."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

from load_tests import common  # noqa: E402
from load_tests import make_gguf_checkpoint as mg  # noqa: E402
from load_tests.gguf_pack import (  # noqa: E402
    q4_k_m_type,
    quantize_k,
    quantize_q8_0,
    use_more_bits,
)
from tests import quant_checkpoints as qc  # noqa: E402
from tests.load.scripts import run_main  # noqa: E402

# (elements, bytes) per block
BLOCK = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q5_0": (32, 22), "Q8_0": (32, 34), "F32": (1, 4)}


def _numpy_blocks(w: np.ndarray, kind: str) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return qc._q6_k(w) if kind == "Q6_K" else qc._q45_k(w, 4)


def _dequantize(blocks: np.ndarray, kind: str) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])


def _error_bound(w: np.ndarray, kind: str) -> np.ndarray:
    """One quantization step of each element's group (twice the ideal half step: the 6-bit
    scale and min are rounded too), as an array of w's shape."""
    N, K = w.shape
    if kind == "Q4_K":
        g = w.reshape(N, K // 32, 32)
        lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        step = (hi - lo) / 15
    else:
        g = w.reshape(N, K // 16, 16)
        step = np.abs(g).max(-1) / 31
    return np.repeat(step, g.shape[-1], axis=-1).reshape(N, K) + 1e-6


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("scale", [0.02, 1.0])
def test_torch_blocks_equal_the_numpy_packer_and_decode_with_gguf(kind, scale, seed) -> None:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((48, 768)) * scale).astype(np.float32)
    w[1] += 3 * scale  # rows of one sign: mins of 0 (all positive) and of the whole range
    w[2] -= 3 * scale
    got = quantize_k(torch.from_numpy(w), kind, max_elems=4096).numpy()  # several row chunks
    assert got.dtype == np.uint8 and got.shape == (48, 768 // 256 * BLOCK[kind][1])
    np.testing.assert_array_equal(got, _numpy_blocks(w, kind))
    deq = _dequantize(got, kind)
    err = np.abs(deq - w)
    assert (err <= _error_bound(w, kind)).all(), float((err / _error_bound(w, kind)).max())
    # the typical error is a fraction of a step, not the bound
    assert err.mean() < 0.35 * _error_bound(w, kind).mean()


@pytest.mark.parametrize("scale", [0.02, 1.0])
def test_torch_q8_0_blocks_equal_gguf_own_quantizer(scale, seed) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((40, 256)) * scale).astype(np.float32)
    w[0, :32] = 0  # a block of zeros: d = 0
    w[1, :32] = np.arange(32) - 15.5  # halves at every other code: rounded away from zero
    got = quantize_q8_0(torch.from_numpy(w), max_elems=1024).numpy()  # several row chunks
    assert got.dtype == np.uint8 and got.shape == (40, 256 // 32 * 34)
    want = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(got, want)
    deq = _dequantize(got, "Q8_0")
    step = np.repeat(np.abs(w.reshape(40, 8, 32)).max(-1) / 127, 32, -1).reshape(40, 256)
    # half a step, and up to 127 codes times d's rounding to fp16 (2^-11 relative)
    assert (np.abs(deq - w) <= (0.5 + 127 * 2**-11) * step + 1e-7).all()


def test_q8_0_mix_writes_every_matrix_q8_0_and_loads_as_gguf_dequantizes(tmp_path) -> None:
    import gguf
    from voltserve.services.executor.loader import load_model

    src = qc.float_checkpoint("llama", rope_scaling=False)
    out = tmp_path / "q8" / "model.gguf"
    run_main("make_gguf_checkpoint", ["--src", str(src), "--out", str(out), "--mix", "q8_0"])
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {types[n] for n in types if not n.endswith("norm.weight")} == {"Q8_0"}
    assert types["token_embd.weight"] == types["output.weight"] == "Q8_0"
    assert {types[n] for n in types if n.endswith("norm.weight")} == {"F32"}
    assert int(reader.fields["general.file_type"].parts[-1][0]) == 7  # MOSTLY_Q8_0
    head = next(t for t in reader.tensors if t.name == "output.weight")
    deq = torch.from_numpy(_dequantize(np.asarray(head.data), "Q8_0").copy())
    model = load_model(out, torch.float32, torch.device("cpu")).model
    x = torch.randn(3, deq.shape[1])
    torch.testing.assert_close(model.lm_head(x), x @ deq.t())


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_degenerate_super_blocks_decode_exactly_or_within_a_step(kind, seed) -> None:
    """A super-block of zeros (d = 0) and one with no negative value (dmin below fp16's range)
    divide by zero in the plain formulas: they decode to zeros / within a step, not garbage."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((4, 512)) * 0.02).astype(np.float32)
    w[0, :256] = 0
    w[1] = np.abs(w[1])
    w[2, 256:] = -np.abs(w[2, 256:])
    w[3] = 0
    deq = _dequantize(quantize_k(torch.from_numpy(w), kind).numpy(), kind)
    assert (deq[0, :256] == 0).all() and (deq[3] == 0).all()
    assert (np.abs(deq - w) <= _error_bound(w, kind)).all()


def test_q4_k_m_rule_at_the_llama3_8b_shape() -> None:
    more = [i for i in range(32) if use_more_bits(i, 32)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    for i in range(32):
        names += [f"blk.{i}.{n}.weight" for n in ("attn_norm", "ffn_norm")]
        names += [
            f"blk.{i}.{n}.weight"
            for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        ]
    counts: dict[str, int] = {}
    for n in names:
        kind = q4_k_m_type(n, 32, 4096, 1 if n.endswith("norm.weight") else 2)
        counts[kind] = counts.get(kind, 0) + 1
    # llama.cpp's Q4_K_M file of Llama-3-8B: 65 f32, 193 q4_K, 33 q6_K tensors
    assert counts == {"F32": 65, "Q4_K": 193, "Q6_K": 33}
    assert q4_k_m_type("blk.6.attn_v.weight", 32, 4096, 2) == "Q6_K"
    assert q4_k_m_type("blk.7.ffn_down.weight", 32, 14336, 2) == "Q4_K"
    # rows that are not whole super-blocks: llama.cpp's fallbacks
    assert q4_k_m_type("blk.0.attn_q.weight", 32, 64, 2) == "Q5_0"
    assert q4_k_m_type("blk.0.ffn_down.weight", 32, 128, 2) == "Q8_0"
    assert q4_k_m_type("output.weight", 32, 64, 2) == "Q8_0"


def _expected_bytes(shapes: dict[str, tuple[int, ...]], types: dict[str, str]) -> int:
    total = 0
    for name, shape in shapes.items():
        elems, nbytes = BLOCK[types[name]]
        total += int(np.prod(shape)) // elems * nbytes
    return total


def test_script_file_equals_the_tests_writer_and_loads_as_gguf_dequantizes(tmp_path) -> None:
    import gguf
    from voltserve.services.executor.loader import load_model

    layers = qc.QUANT_TINY["num_hidden_layers"]

    def rule(name: str) -> str:
        return q4_k_m_type(name, layers, 256, 2)

    ref_dir = qc.gguf_checkpoint("llama", rule, "script-rule", llama3_rope=True)
    src = qc.float_checkpoint("llama", rope_scaling=True)
    out = tmp_path / "q4km" / "model.gguf"
    run_main("make_gguf_checkpoint", ["--src", str(src), "--out", str(out), "--device", "cpu"])
    ours = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    ref = {t.name: t for t in gguf.GGUFReader(str(ref_dir / "model.gguf")).tensors}
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert ours[name].tensor_type == t.tensor_type, name
        np.testing.assert_array_equal(np.asarray(ours[name].data), np.asarray(t.data), name)
    types = {n: t.tensor_type.name for n, t in ours.items()}
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == types["token_embd.weight"] == "Q4_K"
    assert types["output.weight"] == "Q6_K" and types["blk.0.attn_norm.weight"] == "F32"

    # voltserve's loader: every linear computes with gguf's dequantization of the file's blocks
    def deq(name: str) -> torch.Tensor:
        t = ours[name]
        return torch.from_numpy(_dequantize(np.asarray(t.data), t.tensor_type.name).copy())

    def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:  # llama.cpp order -> HF rows
        n = w.shape[0]
        return w.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1)

    model = load_model(out, torch.float32, torch.device("cpu")).model
    cfg = json.loads((src / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    x = torch.randn(3, cfg["hidden_size"])
    for i, layer in enumerate(model.model.layers):
        qkv = torch.cat(
            [
                unpermute(deq(f"blk.{i}.attn_q.weight"), heads),
                unpermute(deq(f"blk.{i}.attn_k.weight"), kv),
                deq(f"blk.{i}.attn_v.weight"),
            ]
        )
        torch.testing.assert_close(layer.self_attn.qkv_proj(x), x @ qkv.t())
        gate_up = torch.cat([deq(f"blk.{i}.ffn_gate.weight"), deq(f"blk.{i}.ffn_up.weight")])
        torch.testing.assert_close(layer.mlp.gate_up_proj(x), x @ gate_up.t())
        h = torch.randn(3, cfg["intermediate_size"])
        torch.testing.assert_close(layer.mlp.down_proj(h), h @ deq(f"blk.{i}.ffn_down.weight").t())
    torch.testing.assert_close(model.lm_head(x), x @ deq("output.weight").t())
    torch.testing.assert_close(model.model.embed_tokens.weight, deq("token_embd.weight"))
    # and the un-permuted q rows are the float checkpoint's, within Q4_K's error
    from safetensors.torch import load_file

    w = load_file(src / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    q = unpermute(deq("blk.0.attn_q.weight"), heads)
    assert (q - w).abs().max() < 0.15 * w.abs().max()

    # the floor counts what the file stores, the embedding left out (a gather)
    shapes = {n: tuple(int(s) for s in t.shape) for n, t in ours.items()}
    rb = common.checkpoint_read_bytes(out)
    assert rb == common.checkpoint_read_bytes(out.parent)  # the folder names the same file
    assert rb["total_bytes"] == _expected_bytes(shapes, types)
    assert rb["embedding_bytes"] == 384 * 256 // 256 * 144
    assert rb["read_per_token_bytes"] == rb["total_bytes"] - rb["embedding_bytes"]
    assert common.quantized_checkpoint(out) and common.quantized_checkpoint(out.parent)
    assert not common.quantized_checkpoint(src)
    # a second call with the same arguments reuses the file
    again = mg.convert(src, out, device="cpu")
    assert again["reused"] is True


def test_bench_decode_serves_a_gguf_file_with_its_stored_bytes_as_the_floor(tmp_path) -> None:
    """The tiny preset's rows (64, 128) are no whole super-blocks: llama.cpp's fallbacks (Q5_0
    for Q4_K, Q8_0 for Q6_K and the head) stand in, the same code path as the 8B's K-quants."""
    src, out = tmp_path / "fp32", tmp_path / "decode.json"
    gg = tmp_path / "q4km" / "model.gguf"
    common.write_random_checkpoint(src, "tiny", "cpu", torch.float32)
    run_main("make_gguf_checkpoint", ["--src", str(src), "--out", str(gg), "--device", "cpu"])
    args = ["--preset", "tiny", "--device", "cpu", "--prompt-len", "8", "--output-len", "3"]
    args += ["--runs", "1", "--warmup", "0", "--bandwidth-bytes", str(1 << 20)]
    run_main(
        "bench_decode",
        [*args, "--model-dir", str(gg.parent), "--skip-transformers", "--out", str(out)],
    )
    d = json.loads(out.read_text())
    assert d["errors"] == {} and d["model"]["quantized"] is True and d["model"]["format"] == "gguf"
    assert "checkpoint_write_s" not in d and d["engine"]["decode_tok_s"] > 0
    p = common.PRESETS["tiny"]
    H, F, V, L = p["hidden_size"], p["intermediate_size"], p["vocab_size"], p["num_hidden_layers"]
    kvd = H // p["num_attention_heads"] * p["num_key_value_heads"]
    shapes = {"output_norm.weight": (H,), "output.weight": (V, H)}
    types = {"output_norm.weight": "F32", "output.weight": "Q8_0"}
    for i in range(L):
        for n, shape in {
            "attn_norm": (H,),
            "ffn_norm": (H,),
            "attn_q": (H, H),
            "attn_k": (kvd, H),
            "attn_v": (kvd, H),
            "attn_output": (H, H),
            "ffn_gate": (F, H),
            "ffn_up": (F, H),
            "ffn_down": (H, F),
        }.items():
            name = f"blk.{i}.{n}.weight"
            shapes[name] = shape
            more = n in ("attn_v", "ffn_down") and use_more_bits(i, L)
            types[name] = "F32" if len(shape) == 1 else "Q8_0" if more else "Q5_0"
    want = _expected_bytes(shapes, types)
    assert d["model"]["read_per_token_bytes"] == d["floor"]["weight_read_bytes"] == want
    assert d["model"]["embedding_bytes"] == V * H // 32 * 22
    assert d["floor"]["ms_per_token"] > 0
