"""GGUF K-quant linears kept in their block bytes (quant/kquant.py, VOLTSERVE_GGUF_KQUANT=1) through
the model runner against transformers loading the same .gguf file (fp32, CPU: the kernels'
torch reference, ggml's values): a Q4_K_M llama, whose merged qkv holds Q4_K q/k beside a Q6_K v
in its first layers and whose lm_head is Q6_K, each shard served in its own type."""

from __future__ import annotations

import pytest
from voltserve.kernels.linear.kquant_linear import KQUANT_ENV
from voltserve.kernels.linear.kquant_pack import KQuantWeight
from voltserve.services.executor.gguf_source import GGUFSource

from tests import quant_checkpoints as qc
from tests.engine.test_quant_models import check_against_reference


@pytest.mark.parametrize("arch", ["llama"])
def test_q4_k_m_blocks_kept_match_transformers(arch: str, seed: int, monkeypatch) -> None:
    monkeypatch.setenv(KQUANT_ENV, "1")
    d = qc.gguf_checkpoint(arch, qc.q4_k_m_types, "Q4_K_M")
    runner = check_against_reference(d / "model.gguf", d, gguf=True, seed=seed)
    src = GGUFSource(d / "model.gguf")
    model = runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    kinds = [s.weight.kind for s in qkv.kquant]
    assert kinds == ["Q4_K", "Q6_K"], kinds  # q and k one segment, v its own
    assert [s.start for s in qkv.kquant] == [0, qkv.out_features - qkv.shard_offsets["v"][1]]
    # every kept linear holds exactly its tensors' file bytes
    for lin, names in (
        (qkv, ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"]),
        (model.lm_head, ["output.weight"]),
    ):
        held = sum(s.weight.nbytes() for s in lin.kquant)
        assert held == sum(src.tensors[n].data.nbytes for n in names)
        assert all(isinstance(s.weight, KQuantWeight) for s in lin.kquant)
    assert model.lm_head.kquant[0].weight.kind == "Q6_K"


def test_switch_off_unpacks(monkeypatch) -> None:
    """VOLTSERVE_GGUF_KQUANT=0: the group-quantized method (codes + scales) as before."""
    from voltserve.services.executor.quant.group import GroupQuantMethod
    from voltserve.services.executor.quant.kquant import KQuantMethod

    src = GGUFSource(qc.gguf_checkpoint("llama", qc.q4_k_m_types, "Q4_K_M") / "model.gguf")
    prefixes = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    monkeypatch.setenv(KQUANT_ENV, "0")
    assert isinstance(src.quant.method_for(prefixes), GroupQuantMethod)
    monkeypatch.setenv(KQUANT_ENV, "auto")  # CPU here: off
    assert isinstance(src.quant.method_for(prefixes), GroupQuantMethod)
    monkeypatch.setenv(KQUANT_ENV, "1")
    assert isinstance(src.quant.method_for(prefixes), KQuantMethod)
    monkeypatch.setenv(KQUANT_ENV, "sometimes")
    with pytest.raises(ValueError, match=KQUANT_ENV):
        src.quant.method_for(prefixes)
