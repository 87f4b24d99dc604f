"""Which modules a quantization config leaves float (AWQ's modules_to_not_convert): an entry
names a module by whole dotted components, never by a substring of one."""

from __future__ import annotations

import pytest
from voltserve.services.executor.quant.base import module_listed


@pytest.mark.parametrize(
    ("name", "entries", "want"),
    [
        # an MoE router listed as AutoAWQ lists it; the dense MLP's gate_proj beside it is not
        ("model.layers.0.mlp.gate", ["mlp.gate"], True),
        ("model.layers.0.mlp.gate_proj", ["mlp.gate"], False),
        ("model.layers.0.mlp.shared_expert_gate", ["mlp.gate"], False),
        ("model.layers.0.mlp.experts.3.gate_proj", ["mlp.gate"], False),
        ("lm_head", ["lm_head"], True),
        ("lm_head", ["lm_head.weight"], False),
        # an entry naming a layer covers everything under it, not layer 30
        ("model.layers.3.self_attn.q_proj", ["model.layers.3"], True),
        ("model.layers.30.self_attn.q_proj", ["model.layers.3"], False),
        ("model.layers.3.self_attn.q_proj", ["self_attn"], True),
        ("model.layers.3.self_attn.q_proj", ["self_attn.q"], False),
        ("model.layers.3.mlp.experts.4.up_proj", ["experts.4"], True),
        ("model.layers.3.mlp.experts.41.up_proj", ["experts.4"], False),
        ("model.layers.3.mlp.down_proj", [], False),
        ("model.layers.3.mlp.down_proj", ["visual", "down_proj"], True),
    ],
)
def test_module_listed_matches_whole_dotted_components(
    name: str, entries: list[str], want: bool
) -> None:
    assert module_listed(name, entries) is want
