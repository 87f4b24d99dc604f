"""A proposer is added by registering its method in spec/registry.py and nothing else: the
config accepts the method, the runner builds it and calls its start-up hooks, the engine binds
it and calls it every step, and speculation's output equals speculation off."""

from __future__ import annotations

from voltserve.services.executor.engine import LLMEngine
from voltserve.services.executor.engine_args import engine_config
from voltserve.services.executor.request import Request
from voltserve.services.executor.spec import registry
from voltserve.services.executor.spec.config import SpeculativeConfig
from voltserve.services.executor.spec.proposer import Proposer
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams

from tests.checkpoints import checkpoint


class RepeatProposer(Proposer):
    """Proposes the last token k times; records the hooks it saw."""

    def __init__(self, num_speculative_tokens: int) -> None:
        super().__init__(num_speculative_tokens)
        self.calls: list[str] = []

    def load(self, runner) -> None:
        self.calls.append("load")

    def alloc_kv(self, runner, num_blocks: int) -> None:
        self.calls.append(f"alloc_kv {num_blocks}")

    def bind(self, block_manager) -> None:
        self.calls.append("bind")

    def observe(self, output) -> None:
        if "observe" not in self.calls:
            self.calls.append("observe")

    def propose(self, requests: list[Request]) -> list[list[int]]:
        if requests and "propose" not in self.calls:
            self.calls.append("propose")
        return [[r.last_token_id] * self.k for r in requests]


def _cfg(spec) -> EngineConfig:
    return engine_config(
        model=str(checkpoint("llama")),
        device="cpu",
        dtype="float32",
        num_kv_blocks=32,
        max_model_len=128,
        max_num_seqs=4,
        speculative_config=spec,
    )


def test_a_registered_proposer_runs_through_runner_and_engine(rng, monkeypatch) -> None:
    monkeypatch.setitem(registry.METHODS, "repeat", registry.Method(RepeatProposer))
    spec = {"method": "repeat", "num_speculative_tokens": 2}
    assert SpeculativeConfig.from_dict(spec).method == "repeat"
    eng = LLMEngine(_cfg(spec))
    p = eng.proposer
    assert isinstance(p, RepeatProposer) and p is eng.runner.proposer
    prompts = [[rng.randrange(200) for _ in range(rng.randint(3, 9))] * 2 for _ in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = LLMEngine(_cfg(None)).generate(prompts, params)
    assert eng.generate(prompts, params) == want
    assert p.calls == ["load", f"alloc_kv {eng.runner.num_kv_blocks}", "bind", "observe", "propose"]
    assert eng.stats().spec_decode_num_drafts > 0
    assert eng.check_all_free()
