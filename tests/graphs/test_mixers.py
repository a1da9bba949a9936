"""Attribution graphs through linear mixers: each kind of mixer linearised by freezing its data-dependent gates
(`nncanon.components.mixer_gates`) builds a graph on its tiny registry variant that `nncanon.graphs.verify` proves:
the frozen forward is the clean run's, each target is its row sum plus its bias term (the frozen model is affine in
the sources), removing a sampled source moves every target by minus its column. A gate left live makes the same
proof fail, and each gate left live makes the frozen model non-affine along a direction of the token nodes (so every
gate frozen is needed); a mixer whose gates are not frozen is declined by name.
"""

from __future__ import annotations

import pytest
import torch

from nncanon import ValueNotAvailable, graphs
from nncanon.components import mixer_gates
from nncanon.graphs import replacement
from nncanon.graphs.proof import prove
from nncanon.testing import tiny_model
from nncanon.versions import transformers_minor

from ..conftest import variant_params

#: One registry variant per kind of mixer linearised (`mixer_gates.KINDS`).
KINDS = {"lfm2": "short convolution", "jamba": "Mamba", "bamba": "Mamba-2", "qwen3_5_text": "gated DeltaNet",
         "recurrent_gemma": "RG-LRU", "xlstm": "mLSTM"}

PROMPT = "The cat sat on the mat"
#: The mixer kinds whose gates name transformers 5.25's calls (``causal_conv1d_forward``, ``mamba_scan_forward``,
#: ``mamba2_scan_forward``, ``torch_chunk_gated_delta_rule``...); before 5.25 their forwards call the convolution and
#: the scan otherwise, and the mixer is declined with that reason.
SPELT_IN_5_25 = ("jamba", "bamba", "qwen3_5_text")


def _declined_by_version(variant, model) -> bool:
    """Before transformers 5.25 a mixer of `SPELT_IN_5_25` is declined, naming the call its forward lacks
    (asserted); ``True`` there, ``False`` where its graph is built."""
    if variant.name not in SPELT_IN_5_25 or transformers_minor() >= (5, 25):
        return False
    with pytest.raises(ValueNotAvailable, match=r"makes no call .* in this transformers version"):
        replacement.plan_of(model)
    assert "in this transformers version" in (graphs.support(model) or "")
    return True


@pytest.mark.parametrize("variant", variant_params(KINDS))
def test_mixer_graph_is_exact(variant):
    model = tiny_model(variant)
    mixers = [layer.__dict__["linear_attn"]._module for layer in model.layers if layer.__dict__.get("linear_attn")]
    assert mixers and {mixer_gates.GATES[type(m).__name__][1] for m in mixers} == {KINDS[variant.name]}
    if _declined_by_version(variant, model):
        return
    assert graphs.support(model) is None
    transcoders = graphs.random_transcoders(model, n_features=12, seed=1)
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=3, max_feature_nodes=20, batch_size=16)
    check = graphs.verify(model, graph, transcoders, samples=4)
    assert check.ok, f"{variant.name}: {check}"
    assert check.forward < 1e-5  # the SiLU's frozen slope leaves the forward's value the clean run's


def _second_difference(model) -> float:
    """The frozen model's largest second difference along a random direction of the token nodes (steps 0, 1, 2),
    over every transcoder input and the head's output, relative to its first difference: ~1e-7 where the frozen
    model is affine in the token nodes."""
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    plan = replacement.plan_of(model)
    clean = replacement.clean_run(model, ids, plan)
    embeddings, outputs = clean.embeddings[None], [output[None] for output in clean.outputs]
    direction = torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(0)) * embeddings.std() * 10
    with torch.no_grad():
        runs = [replacement.frozen_run(model, ids, plan, clean, embeddings + step * direction, outputs)
                for step in (0.0, 1.0, 2.0)]
    worst = 0.0
    for f0, f1, f2 in zip(*[[*inputs, head] for inputs, head in runs], strict=True):
        worst = max(worst, float((f2 - 2 * f1 + f0).abs().max() / (f1 - f0).abs().max()))
    return worst


@pytest.mark.parametrize("variant", variant_params(KINDS))
def test_every_gate_is_needed(variant, monkeypatch):
    """With every gate frozen the frozen model is affine along a direction of the token nodes (second difference
    ~1e-7); with any one gate left live it is not (measured 5e-4 to 2.5 on the tiny models: Jamba's convolution SiLU,
    the weakest, is 5e-4, under the graph proof's sampled 1e-4 on the proof's small prompt, hence this check too)."""
    model = tiny_model(variant)
    name = next(type(layer.__dict__["linear_attn"]._module).__name__ for layer in model.layers
                if layer.__dict__.get("linear_attn"))
    gates, kind = mixer_gates.GATES[name]
    if _declined_by_version(variant, model):
        return
    assert _second_difference(model) < 1e-5
    for left in gates:
        monkeypatch.setitem(mixer_gates.GATES, name, (tuple(gate for gate in gates if gate != left), kind))
        assert _second_difference(model) > 1e-4, f"{name}: {left} left live"


@pytest.mark.parametrize("variant", variant_params(["lfm2"]))
def test_a_live_gate_is_caught_by_the_proof(variant, monkeypatch):
    """Without B and C frozen, the short convolution is quadratic in the stream: the graph proof declines it."""
    monkeypatch.setitem(mixer_gates.GATES, "Lfm2ShortConv", ((), "short convolution"))
    reason = prove(tiny_model(variant))
    assert reason is not None and "not affine" in reason


@pytest.mark.parametrize("variant", variant_params(["lfm2", "mamba"]))
def test_mixers_not_linearised_are_declined_with_the_reason(variant, monkeypatch):
    """A mixer class without gates to freeze is declined by name (every registered one has them: one is taken out
    here); a block without an MLP is declined for that first."""
    monkeypatch.delitem(mixer_gates.GATES, "Lfm2ShortConv")
    model = tiny_model(variant)
    reason = graphs.support(model)
    expected = {"lfm2": "its linear mixer (Lfm2ShortConv) is not one whose data-dependent gates nncanon freezes",
                "mamba": "serves no mlp_output"}[variant.name]
    assert reason is not None and expected in reason
    assert model.support().graphs == f"no, {reason}"
    with pytest.raises(ValueNotAvailable, match="no attribution graph"):
        graphs.attribute(model, PROMPT, None)
