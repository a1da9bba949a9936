"""Attribution graphs on Gemma-3n: its AltUp streams, LAuReL branch and per-layer-input branch frozen.

A Gemma-3n block (`nncanon.families.gemma3n`) predicts its ``k`` stacked streams from all of them with coefficients
routed from the active stream (AltUp's ``predict``: the router's ``tanh``), adds a low-rank LAuReL branch whose
post-norm rescales it, and writes the sublayers' result into every stream with coefficients routed from that result
(AltUp's ``correct``: the same router module, called a second time); after it, a per-layer-input branch
``norm(proj(gelu(gate(a)) · p))``. The model stacks its streams from the embeddings by projections rescaled to the
embeddings' magnitude, and collapses them before the final norm alike. Frozen at the clean run's values: the router's
output in each call (read through its caller, ``self_altup_predict_0`` / ``self_altup_correct_0``), LAuReL's
post-norm scale, the per-layer input ``p`` at the block's entry, the branch's GELU as its slope and its norm's scale
(`nncanon.components.norm_gates.BLOCK_GATES`), the value norm (`nncanon.components.attention_gates`), the
magnitudes rescaling the stacking and the collapse, with the final norm's scale (`nncanon.graphs.streams`,
`nncanon.graphs.head`). With all frozen the graph is exact; with any one left live the frozen model is not affine
along a direction of the token nodes, and the linearity proof declines it.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from nncanon import StandardizedTransformer, graphs
from nncanon.components import attention_gates, norm_gates
from nncanon.graphs import head, replacement, streams
from nncanon.graphs.proof import prove
from nncanon.testing import tiny_model, tiny_tokenizer

from ..conftest import variant_params
from ..test_gemma3n import _multimodal
from .conftest import assert_exact_graph
from .test_mixers import _second_difference

BLOCK = "Gemma3nTextDecoderLayer"
#: The block's own values, by place and index in `norm_gates.BLOCK_GATES`'s entry (for the messages).
GATES = {("first", 0): "the per-layer input", ("first", 1): "AltUp's prediction coefficients (the router in predict)",
         ("attention", 0): "LAuReL's post-norm scale",
         ("last", 0): "AltUp's correction coefficients (the router in correct)",
         ("last", 1): "the per-layer-input branch's GELU", ("last", 2): "the per-layer-input branch's norm scale"}
#: The tiny model's AltUp router reads its RMS-normed input times ``1/d`` through weights of about 0.02, and its
#: coefficient maps are about 0.02 too, so its routed coefficients hardly move over the prompt (each router left live
#: moves the second difference by 1e-5 only, under the proof's 1e-4); the test runs it with the router's weights 100
#: times and the coefficient maps 30 times larger (coefficients of order 0.1 to 1, a trained model's), and puts them
#: back.
SHARPEN = {"modality_router": 100.0, "prediction_coefs": 30.0, "correction_coefs": 30.0}


@contextmanager
def _sharpened(model):
    """``model`` with its AltUp routers' weights multiplied by `SHARPEN`."""
    weights = [(getattr(block._module.altup, name).weight, factor) for block in model.layers
               for name, factor in SHARPEN.items()]
    with torch.no_grad():
        for weight, factor in weights:
            weight.mul_(factor)
    try:
        yield model
    finally:
        with torch.no_grad():
            for weight, factor in weights:
                weight.div_(factor)


@pytest.mark.parametrize("variant", variant_params(["gemma3n_text", "gemma3n_text_unshared"]))
def test_graph_is_exact(variant):
    """Both tiny variants (4 streams and KV sharing; 2 streams, the second active) freeze the block's values at its
    entry, before the attention's pattern and last, and the collapse at the head; the 2-stream one builds a graph
    `graphs.verify` proves (both are in tests/graphs/test_families.py's `BUILT`)."""
    model = tiny_model(variant)
    plan = replacement.plan_of(model)
    assert plan.stacked and [kind for _, _, kind in plan.head_stages] == ["collapse"]
    assert plan.writes == "mlp_module_output" and not plan.final_norm
    for steps in plan.steps:
        assert steps[0] == replacement.NORM_GATES + "<block entry>" and steps[-1] == replacement.NORM_GATES + "<block>"
        at = steps.index(replacement.NORM_GATES + "<block attention>")
        assert steps[at - 1] == "attention_norm_scale" and "attention_probabilities" in steps[at + 1:at + 3]
    if variant.name == "gemma3n_text_unshared":
        assert_exact_graph(model, variant.name)


@pytest.mark.parametrize("variant", variant_params(["gemma3n_text_unshared"]))
def test_every_frozen_value_is_needed(variant, monkeypatch):
    """Frozen, the model is affine along a direction of the token nodes (second difference ~1e-6); with any one value
    left live (each block value, the value norm, the stacking's magnitudes, the collapse's with the final norm) it is
    not, and the linearity proof declines the model ("not affine"; but for the stacking's: `_assert_live_caught` says
    why)."""
    with _sharpened(tiny_model(variant)) as model:
        assert _second_difference(model) < 1e-5
        entry = norm_gates.BLOCK_GATES[BLOCK]
        for (place, index), what in GATES.items():
            with monkeypatch.context() as patch:
                patch.setitem(norm_gates.BLOCK_GATES, BLOCK, lambda block, place=place, index=index: {
                    at: tuple(gate for i, gate in enumerate(gates) if (at, i) != (place, index))
                    for at, gates in entry(block).items()})
                _assert_live_caught(model, what)
        with monkeypatch.context() as patch:
            patch.delitem(attention_gates.ATTENTION_GATES, "Gemma3nTextAttention")
            _assert_live_caught(model, "the value norm")
        with monkeypatch.context() as patch:
            patch.setattr(replacement.streams, "stacked", lambda model: False)
            _assert_live_caught(model, "the stacking's magnitudes", proof=False)
        with monkeypatch.context() as patch:
            patch.setattr(replacement.before_head, "stages", lambda model: [])
            _assert_live_caught(model, "the collapse's magnitudes and the final norm's scale")


def _assert_live_caught(model, what: str, proof: bool = True) -> None:
    """Left live, ``what`` makes the frozen model non-affine along a direction of the token nodes, and (``proof``)
    the linearity proof declines the model. (The stacking's magnitudes left live are not seen by the proof: each
    position's stacked stream is then ``e ↦ P·e·|e|/|P·e|``, positively homogeneous of degree 1 in that position's
    token vector alone, so by Euler's theorem its gradient times the vector is its value, and the rows still sum and a
    token node's removal still moves the targets by its edges; the edges are those of a gradient at a live ratio, not
    the frozen model's.)"""
    live = _second_difference(model)
    assert live > 1e-4, f"{what} left live moves the second difference only to {live:.1e}"
    if not proof:
        return
    reason = prove(model)
    assert reason is not None and "not affine" in reason, f"{what} left live: {reason}"


def test_frozen_stacking_and_collapse_are_the_models():
    """The family's rescaling with the clean magnitudes given is its own computation, bit for bit: the stacked stream
    entering block 0 and the collapse before the final norm equal the model's (the served ``layers[0].layer_input``,
    and the family's ``collapse`` of the last block's output); the magnitudes are ``[1, n, 1]``, the embeddings' and
    each projection's."""
    model = tiny_model("gemma3n_text")
    ids = model.tokenizer("The cat sat", return_tensors="pt").input_ids
    with torch.no_grad(), model.trace(ids):
        embeddings = model.token_embeddings.save()
        entering = model.layers[0].layer_input.save()
        last = model.layers[-1].layer_output.save()
    magnitudes = streams.expand_magnitudes(model, embeddings[0])
    assert len(magnitudes) == model.config.altup_num_inputs and magnitudes[0].shape == (1, ids.shape[1], 1)
    rescale = model._family.rescale
    with torch.no_grad():
        assert torch.equal(rescale(model._module, "expand", embeddings, magnitudes)[0], entering)
        _, clean = rescale(model._module, "collapse", last)
        assert torch.equal(rescale(model._module, "collapse", last, clean)[0],
                           rescale(model._module, "collapse", last)[0])
    assert head.COLLAPSE in [path for path, _, _ in head.stages(model)]


def test_multimodal_text_path_builds(monkeypatch):
    """Gemma3nForConditionalGeneration's text path (the ``gemma3n`` family: its blocks under
    ``model.language_model``; the timm vision tower replaced where timm is not installed) builds an exact graph."""
    model = StandardizedTransformer(_multimodal(monkeypatch), tokenizer=tiny_tokenizer(300), verify="never")
    assert model.family.name == "gemma3n"
    assert_exact_graph(model, "gemma3n")


def test_under_sdpa():
    """Under sdpa the pattern is frozen through the kernel's query and key: the 2-stream variant builds an exact
    graph; the KV-sharing one is declined by name (a block's keys are one tensor shared with a later block's)."""
    assert_exact_graph(tiny_model("gemma3n_text_unshared", attn_implementation="sdpa"), "gemma3n_text_unshared")
    reason = graphs.support(tiny_model("gemma3n_text", attn_implementation="sdpa"))
    assert reason is not None and "KV sharing" in reason and "key_states" in reason
