"""The layers' add + RMSNorm folded into the next linear's launch (models/layers.PreNorm): at
decode with one or two rows the plain-weight qkv (with rotary and the KV write) and gate_up
linears take the pre-norm ops; with three rows, or where the qkv is not the fused kind (q/k
norm: Qwen3), the norm runs first as before. On CPU the ops are their references, so this checks
the wiring: which op each step takes, and that greedy tokens still equal transformers."""

from __future__ import annotations

import pytest
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.request import Request
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint, drive, hf_greedy, tokenizer

FOLDS = ("gemv_qkv_rope_prenorm", "gemv_gate_up_prenorm")


def _spy(runner: ModelRunner) -> dict[str, list[int]]:
    """Wrap the pre-norm ops of the runner's dispatch: the row count of every call, by op."""
    calls: dict[str, list[int]] = {op: [] for op in FOLDS}
    for op in FOLDS:
        fn = getattr(runner.ops, op)

        def wrapped(x, *a, _fn=fn, _op=op, **kw):
            calls[_op].append(x.shape[0])
            return _fn(x, *a, **kw)

        setattr(runner.ops, op, wrapped)
    return calls


@pytest.mark.parametrize("arch,batch", [("llama", 1), ("llama", 2), ("llama", 3), ("qwen3", 1)])
def test_decode_folds_the_norms_and_matches_transformers(arch: str, batch: int, rng) -> None:
    runner = ModelRunner(EngineConfig(model=str(checkpoint(arch)), num_kv_blocks=64))
    calls = _spy(runner)
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(rng.randint(3, 20))] for _ in range(batch)]
    max_new = 6
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params, seed=i, arrival_time=0.0) for i, p in enumerate(prompts)]
    drive(runner, reqs, max_new, chunk=32)
    for r, prompt in zip(reqs, prompts):
        want, _ = hf_greedy(checkpoint(arch), prompt, max_new)
        assert r.output_token_ids == want, f"{arch}: prompt of {len(prompt)} tokens"
    layers = len(runner.model.model.layers)
    if batch == 3:  # no pre-norm kernel variant for three rows
        assert calls == {op: [] for op in FOLDS}
        return
    # Every decode step after the first: all layers but the first fold the input norm (the
    # first layer's input has no residual yet), every layer the post-attention norm.
    steps = max_new - 1
    assert calls["gemv_gate_up_prenorm"] == [batch] * (steps * layers)
    want_qkv = 0 if arch == "qwen3" else steps * (layers - 1)
    assert calls["gemv_qkv_rope_prenorm"] == [batch] * want_qkv


def test_quantized_decode_folds_the_norms(rng, monkeypatch) -> None:
    """An AWQ checkpoint: its qkv and gate_up linears fold the norms through quant_linear's
    pre-norm entry points at one decode row, and the tokens and logprobs equal those of the same
    runner with the folds off (the fold's references are the unfused ops composed; the tokens
    against transformers are test_quant_models' check, which walks this path too)."""
    from voltserve.kernels import quant_linear as qk
    from voltserve.services.executor.quant.group import GroupQuantMethod

    from tests import quant_checkpoints as qc

    path, _ = qc.awq_checkpoint("llama", 128)
    V = len(tokenizer())
    prompt = [rng.randrange(V) for _ in range(rng.randint(3, 20))]
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=1, ignore_eos=True)
    calls = {"quant_gate_up_silu_prenorm": 0, "quant_qkv_rope_prenorm": 0}
    for name in calls:
        fn = getattr(qk, name)

        def wrapped(*a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)

        monkeypatch.setattr(qk, name, wrapped)
    runs = []
    for fold in (True, False):
        if not fold:
            monkeypatch.setattr(GroupQuantMethod, "gate_up_silu_prenorm", lambda *a: None)
            monkeypatch.setattr(GroupQuantMethod, "qkv_rope_prenorm", lambda *a: None)
        runner = ModelRunner(EngineConfig(model=str(path), num_kv_blocks=64))
        req = Request("r", prompt, params, seed=0, arrival_time=0.0)
        drive(runner, [req], 5, chunk=32)
        runs.append([(t.token_id, t.logprob) for t in req.trace])
        if fold:
            layers = len(runner.model.model.layers)
            assert calls == {
                "quant_gate_up_silu_prenorm": 4 * layers,
                "quant_qkv_rope_prenorm": 4 * (layers - 1),
            }
    assert runs[0] == runs[1]
