"""Attribution graphs through linear mixers: each kind of mixer linearised by freezing its data-dependent gates
(`nncanon.components.mixer_gates`) builds a graph on its tiny registry variant that `nncanon.graphs.verify` proves:
the frozen forward is the clean run's, each target is its row sum plus its bias term (the frozen model is affine in
the sources), removing a sampled source moves every target by minus its column. A gate left live makes the same
proof fail, and each gate left live makes the frozen model non-affine along a direction of the token nodes (so every
gate frozen is needed); a mixer whose gates are not frozen is declined by name. Both hold on transformers 5.21-5.24,
whose Mamba, Mamba-2 and gated DeltaNet forwards spell their calls otherwise (the older spelling is used there), and
a mixer whose forward makes no spelling's calls is declined naming them.
"""

from __future__ import annotations

import pytest
import torch

from nncanon import ValueNotAvailable, graphs
from nncanon.components import mixer_gates
from nncanon.components.mixer_gates import Gate
from nncanon.graphs import mixers as graph_mixers
from nncanon.graphs import replacement
from nncanon.graphs.proof import prove
from nncanon.testing import tiny_model
from nncanon.versions import transformers_minor

from ..conftest import variant_params

#: One registry variant per kind of mixer linearised (`mixer_gates.KINDS`).
KINDS = {"lfm2": "short convolution", "jamba": "Mamba", "bamba": "Mamba-2", "qwen3_5_text": "gated DeltaNet",
         "recurrent_gemma": "RG-LRU", "xlstm": "mLSTM", "minimax": "lightning attention",
         "rwkv": "WKV (RWKV's time mix)", "zamba": "Mamba (one scan per head)"}
#: The token nodes' step of `test_every_gate_is_needed` where not 10 times their spread: Zamba's tiny scan (its
#: ``dt``, ``B`` and ``C`` small beside the skip ``D·x``) is near linear there (dt, B, C left live: 1e-6; at 1000
#: times: 3e-3, its frozen model 1e-6).
SIZES = {"zamba": 1000.0}

PROMPT = "The cat sat on the mat"
#: The mixer kinds whose forwards spell their calls otherwise before transformers 5.25 (``causal_conv1d_fn``,
#: ``mamba_selective_scan``, ``mamba2_chunk_scan`` for 5.25's ``causal_conv1d_forward``, ``mamba_scan_forward``,
#: ``mamba2_scan_forward``): `mixer_gates.GATES`' second spelling is used there.
RESPELT = ("jamba", "bamba", "qwen3_5_text", "zamba")


def _mixer_layer(model) -> tuple[int, str]:
    """The first block with a linear mixer, and the mixer's class name."""
    return next((i, type(layer.__dict__["linear_attn"]._module).__name__) for i, layer in enumerate(model.layers)
                if layer.__dict__.get("linear_attn"))


def _gates_in_use(variant, model) -> tuple[Gate, ...]:
    """The spelling of the mixer's gates used on this transformers version (asserted: 5.25's where its forward
    makes 5.25's calls, else the older one)."""
    layer, name = _mixer_layer(model)
    spellings, _ = mixer_gates.GATES[name]
    older = variant.name in RESPELT and transformers_minor() < (5, 25)
    gates = graph_mixers._gates(model, layer)
    assert gates == spellings[1 if older else 0], f"{name}: {gates}"
    return gates


@pytest.mark.parametrize("variant", variant_params(KINDS))
def test_mixer_graph_is_exact(variant):
    model = tiny_model(variant)
    mixers = [layer.__dict__["linear_attn"]._module for layer in model.layers if layer.__dict__.get("linear_attn")]
    assert mixers and {mixer_gates.GATES[type(m).__name__][1] for m in mixers} == {KINDS[variant.name]}
    _gates_in_use(variant, model)
    assert graphs.support(model) is None
    transcoders = graphs.random_transcoders(model, n_features=12, seed=1)
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=3, max_feature_nodes=20, batch_size=16)
    check = graphs.verify(model, graph, transcoders, samples=4)
    assert check.ok, f"{variant.name}: {check}"
    assert check.forward < 1e-5  # the SiLU's frozen slope leaves the forward's value the clean run's


def _second_difference(model, size: float = 10.0) -> float:
    """The frozen model's largest second difference along a random direction of the token nodes (steps 0, 1, 2 of
    ``size`` times the token vectors' spread), over every transcoder input and the head's output, relative to its
    first difference: ~1e-7 where the frozen model is affine in the token nodes."""
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    plan = replacement.plan_of(model)
    clean = replacement.clean_run(model, ids, plan)
    embeddings, outputs = clean.embeddings[None], [output[None] for output in clean.outputs]
    direction = torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(0)) * embeddings.std() * size
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
    _, name = _mixer_layer(model)
    gates, kind = _gates_in_use(variant, model), mixer_gates.GATES[name][1]
    size = SIZES.get(variant.name, 10.0)
    assert _second_difference(model, size) < 1e-5
    for left in gates:
        monkeypatch.setitem(mixer_gates.GATES, name, ((tuple(gate for gate in gates if gate != left),), kind))
        assert _second_difference(model, size) > 1e-4, f"{name}: {left} left live"


@pytest.mark.parametrize("variant", variant_params(["bamba"]))
def test_a_forward_making_no_spelling_s_calls_is_declined(variant, monkeypatch):
    """With only the other transformers versions' spelling of its gates, a mixer is declined naming the call its
    forward lacks (5.25's ``causal_conv1d_forward`` before 5.25, ``causal_conv1d_fn`` on 5.25)."""
    model = tiny_model(variant)
    _, name = _mixer_layer(model)
    spellings, kind = mixer_gates.GATES[name]
    other, lacking = ((spellings[1], "causal_conv1d_fn_0") if transformers_minor() >= (5, 25)
                      else (spellings[0], "causal_conv1d_forward_0"))
    monkeypatch.setitem(mixer_gates.GATES, name, ((other,), kind))
    with pytest.raises(ValueNotAvailable, match=f"makes no call '{lacking}' in this transformers version"):
        replacement.plan_of(model)
    assert f"makes no call '{lacking}' in this transformers version" in (graphs.support(model) or "")


@pytest.mark.parametrize("variant", variant_params(["lfm2"]))
def test_a_live_gate_is_caught_by_the_proof(variant, monkeypatch):
    """Without B and C frozen, the short convolution is quadratic in the stream: the graph proof declines it."""
    monkeypatch.setitem(mixer_gates.GATES, "Lfm2ShortConv", (((),), "short convolution"))
    reason = prove(tiny_model(variant))
    assert reason is not None and "not affine" in reason


@pytest.mark.parametrize("variant", variant_params(["lfm2", "mamba"]))
def test_mixers_not_linearised_are_declined_with_the_reason(variant, monkeypatch):
    """A mixer class without gates to freeze is declined by name (every registered one has them: one is taken out
    here); a model without an MLP in any block is declined for that first."""
    monkeypatch.delitem(mixer_gates.GATES, "Lfm2ShortConv")
    model = tiny_model(variant)
    reason = graphs.support(model)
    expected = {"lfm2": "its linear mixer (Lfm2ShortConv) is not one whose data-dependent gates nncanon freezes",
                "mamba": "no block has an MLP for a transcoder"}[variant.name]
    assert reason is not None and expected in reason
    assert model.support().graphs == f"no, {reason}"
    with pytest.raises(ValueNotAvailable, match="no attribution graph"):
        graphs.attribute(model, PROMPT, None)
