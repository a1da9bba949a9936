"""Attribution graphs on blocks that are not "stream + attention + MLP" sums.

- A block without an MLP (Nemotron-H's mixer-only and attention-only blocks; Mllama's cross-attention blocks, which
  do not run on text alone: no steps at all) has no transcoder: no feature there,
  its error nodes zero (no edge in or out), the block linear on the frozen model (its mixer's gates frozen); the
  graph is exact (`nncanon.graphs.verify`). A transcoder given for such a block, or a cross-layer transcoder (it
  decodes into every block), is refused by name.
- A block whose update is not a sum of contributions (Doge's learned residual gains: no ``mlp_output``) gets
  transcoders writing its MLP module's output (``mlp_module_output``): the graph's MLP leaves are the module's
  output as a plain PyTorch hook on the unwrapped model reads it (ZAYA's: the first element of the tuple its MLP
  module returns). Post-LN OPT runs its MLP inline: its transcoders read its up projection's input and write its
  down projection's output (``(b·s, d)`` in the model), its two norms on the block's sums frozen as their scales.
"""

from __future__ import annotations

import pytest
import torch

from nncanon import InvalidDictionary, graphs
from nncanon.graphs import attribution, coders, replacement
from nncanon.testing import tiny_model

from .conftest import assert_exact_graph

PROMPT = "The cat sat on the mat"


@pytest.mark.parametrize("name", ["nemotron_h", "mllama"])
def test_blocks_without_an_mlp_have_no_transcoder(name):
    """(Mllama's cross-attention blocks do not run on text alone, `Family.idle`: no steps at all, not even a mixer's;
    its idle block is known from the family's data, `LayerSupport.runs`.)"""
    model = tiny_model(name)
    mlps = coders.mlp_blocks(model)
    assert any(mlps) and not all(mlps)
    runs = [model.family.idle_reason(model._text_config, layer) is None for layer in range(len(mlps))]
    assert [row.runs for row in model.support().layers] == runs and all(runs) == (name == "nemotron_h")
    transcoders = graphs.random_transcoders(model, n_features=12, seed=1)
    assert [t is not None for t in transcoders] == mlps
    plan = replacement.plan_of(model)
    assert plan.mlp == mlps
    assert all((replacement.INPUT in steps) == mlp for steps, mlp in zip(plan.steps, mlps, strict=True))
    assert all(bool(steps) == ran for steps, ran in zip(plan.steps, runs, strict=True))
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=3, batch_size=16)
    check = graphs.verify(model, graph, transcoders, samples=4)
    assert check.ok, check
    n_pos, a = len(graph.input_tokens), graph.adjacency_matrix
    assert set(graph.active_features[:, 0].tolist()) == {layer for layer, mlp in enumerate(mlps) if mlp}
    for layer, mlp in enumerate(mlps):
        errors = slice(graph.n_features + layer * n_pos, graph.n_features + (layer + 1) * n_pos)
        assert a[:, errors].any() == mlp  # (an MLP block's errors reach some target; the others are zero)
        assert not a[errors].any()
    wrong = list(transcoders)
    wrong[mlps.index(False)] = transcoders[mlps.index(True)]
    with pytest.raises(InvalidDictionary, match="which has no MLP: pass None there"):
        graphs.attribute(model, PROMPT, wrong)
    with pytest.raises(InvalidDictionary, match="decodes into every block's MLP"):
        graphs.attribute(model, PROMPT, graphs.random_clt(model))


@pytest.mark.parametrize("name", ["doge", "zaya"])
def test_a_non_additive_block_writes_its_mlp_module_output(name):
    """(ZAYA's MLP module returns a tuple, its router's state for the next block after its output: the leaf is the
    first element.)"""
    model = tiny_model(name)
    assert not model.support().available("mlp_output", layer=0)
    assert coders.writes_of(model) == replacement.MLP_MODULE_OUTPUT == "mlp_module_output"
    transcoders = graphs.random_transcoders(model, n_features=12, seed=1)
    assert transcoders[0].cfg.hook_name_out == "blocks.0.mlp.hook_out"
    s = attribution.setup(model, PROMPT, transcoders, max_n_logits=2)
    assert s.plan.writes == "mlp_module_output"
    seen = _hooked(model, s.ids, {at: layer.mlp._module for at, layer in enumerate(model.layers)})
    for layer, leaf in enumerate(s.leaves):
        output = seen[layer][1]
        output = output[0] if isinstance(output, tuple) else output
        assert isinstance(seen[layer][1], tuple) == (name == "zaya")
        torch.testing.assert_close(leaf, output[0], rtol=0, atol=0)


def test_an_inline_mlp_writes_its_down_projections_output():
    """Post-LN OPT (``do_layer_norm_before=False``): no ``mlp_output``, an MLP run inline (``fc1``/``fc2`` on the
    tokens flattened); the leaves are ``fc2``'s output as a plain hook reads it, the graph exact."""
    model = tiny_model("opt_postln_proj")
    assert not model.support().available("mlp_output", layer=0)
    transcoders = graphs.random_transcoders(model, n_features=12, seed=1)
    assert (transcoders[0].cfg.hook_name, transcoders[0].cfg.hook_name_out) == ("blocks.0.mlp.hook_in",
                                                                                "blocks.0.mlp.hook_out")
    s = attribution.setup(model, PROMPT, transcoders, max_n_logits=2)
    assert s.plan.writes == "mlp_module_output"
    blocks = model._module.model.decoder.layers
    seen = _hooked(model, s.ids, {**{("in", at): block.fc1 for at, block in enumerate(blocks)},
                                  **{("out", at): block.fc2 for at, block in enumerate(blocks)}})
    for layer, leaf in enumerate(s.leaves):
        assert seen["out", layer][1].dim() == 2  # (run on the tokens flattened)
        torch.testing.assert_close(leaf, seen["out", layer][1].reshape(leaf.shape), rtol=0, atol=0)
        torch.testing.assert_close(s.clean.inputs[layer], seen["in", layer][0].reshape(leaf.shape), rtol=0, atol=0)
    assert_exact_graph(model, "opt_postln_proj")


def _hooked(model, ids, modules: dict) -> dict:
    """Per key of ``modules``, ``(first input, output)`` of that module of the unwrapped model on ``ids``, read by a
    plain PyTorch forward hook."""
    seen = {}
    hooks = [module.register_forward_hook(lambda m, i, o, key=key: seen.__setitem__(key, (i[0], o)))
             for key, module in modules.items()]
    try:
        with torch.no_grad():
            model._module(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return seen
