"""Attribution graphs through attention blocks with a norm inside them (`nncanon.components.attention_gates`):
multi-head latent attention's compressed-KV norm (DeepSeek-V2), BitNet's sub-norm on the heads' output and
Gemma-4's value norm (no weight: its ``pow(mean(x²) + eps, -0.5)``). With the
norm's ``rsqrt`` scale frozen at the clean run's, the graph on the tiny registry variant is one `nncanon.graphs.verify`
proves (forward, completeness, sampled removals) and `graphs.support` is ``None`` (DeepSeek-V2's under sdpa, the
pattern frozen through the kernel's query and key; BitNet's under eager); with the norm left live the frozen
model is not affine along a direction of the token nodes and the linearity proof declines the model.
"""

from __future__ import annotations

import pytest

from nncanon.components import attention_gates
from nncanon.graphs import replacement
from nncanon.graphs.proof import prove
from nncanon.testing import tiny_model

from ..conftest import variant_params
from .conftest import assert_exact_graph
from .test_mixers import _second_difference

#: One registry variant per kind of inner norm: its attention class, the norm, where it runs, and the attention
#: implementation its graph is built under (the pattern frozen as probabilities, or through sdpa's query and key).
KINDS = {"deepseek_v2": ("DeepseekV2Attention", "kv_a_layernorm", "before", "sdpa"),
         "bitnet": ("BitNetAttention", "attn_sub_norm", "after", "eager"),
         "gemma4_text": ("Gemma4TextAttention", "v_norm", "before", "eager")}


@pytest.mark.parametrize("variant", variant_params(KINDS))
def test_inner_norm_graph_is_exact(variant):
    name, norm, place, implementation = KINDS[variant.name]
    model = tiny_model(variant, attn_implementation=implementation)
    attention = model.layers[0].__dict__["self_attn"]._module
    assert type(attention).__name__ == name and attention_gates.place_of(attention) == place
    assert [gate.module for gate in attention_gates.gates_of(attention)] == [norm]
    plan = replacement.plan_of(model)
    for steps in plan.steps:  # the norm's step sits before the pattern (the latent) or after it (the output)
        pattern = [i for i, step in enumerate(steps)
                   if step in ("attention_probabilities", *replacement.PATTERN_INPUTS)]
        assert steps.index(replacement.ATTENTION) == (pattern[0] - 1 if place == "before" else pattern[-1] + 1)
    assert_exact_graph(model, variant.name)


@pytest.mark.parametrize("variant", variant_params(KINDS))
def test_a_live_inner_norm_is_caught(variant, monkeypatch):
    """Frozen, the model is affine along a direction of the token nodes (second difference ~1e-7); with the norm's
    scale left live it is not, and the linearity proof declines the model ("not affine")."""
    name = KINDS[variant.name][0]
    model = tiny_model(variant)
    assert _second_difference(model) < 1e-5
    monkeypatch.delitem(attention_gates.ATTENTION_GATES, name)
    live = _second_difference(model)
    assert live > 1e-4, f"{name}: the inner norm left live moves the second difference only to {live:.1e}"
    reason = prove(model)
    assert reason is not None and "not affine" in reason
