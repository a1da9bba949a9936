"""LongCat-Flash's dense MLPs, which no transcoder maps (`nncanon.families.Family.frozen_sublayers`): the graph writes
each one's output as a leaf at its clean value where the block adds it, and folds it into the block's error node.
The error node is then the MoE's output less the transcoder's reconstruction plus both dense MLPs' outputs (each at
its own place in the block), measured here by plain PyTorch hooks on the unwrapped model; every error node's removal
moves every target by its column (`graphs.verify` with every source sampled). A sublayer the family names that no
block gate writes would stay live: the model is declined, naming it.
"""

from __future__ import annotations

import torch

from nncanon import graphs
from nncanon.components import norm_gates
from nncanon.graphs.attribution import setup
from nncanon.graphs.proof import prove
from nncanon.testing import tiny_model

from .conftest import PROMPT
from .test_mlp_less import _hooked


def test_error_node_holds_the_dense_mlps():
    model = tiny_model("longcat_flash")
    transcoders = graphs.random_transcoders(model, n_features=12, seed=1)
    s = setup(model, PROMPT, transcoders, max_n_logits=2, zero_bos=False)
    assert [(layer, path) for layer, _, path, _ in s.plan.sublayers] == [
        (layer, path) for layer in range(len(model.layers)) for path in ("mlps.0", "mlps.1")]
    blocks = model._module.model.layers  # (each block's shortcut MoE and dense MLPs, by plain PyTorch hooks)
    seen = _hooked(model, s.ids, {(name, layer): module for layer, block in enumerate(blocks)
                                  for name, module in (("moe", block.mlp), ("mlp0", block.mlps[0]),
                                                       ("mlp1", block.mlps[1]))})
    for layer in range(len(model.layers)):
        (moe_in, moe), (_, mlp0), (_, mlp1) = (seen[name, layer] for name in ("moe", "mlp0", "mlp1"))
        with torch.no_grad():
            reconstruction = transcoders[layer](moe_in[0])
        expected = moe[0] - reconstruction + mlp0[0] + mlp1[0]
        node = s.errors[layer] + sum(vector for at, vector in s.folded if at == layer)
        torch.testing.assert_close(node, expected, rtol=1e-5, atol=1e-6)
        assert all(float(vector.abs().max()) > 0 for at, vector in s.folded if at == layer)
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=2, max_feature_nodes=8, zero_bos=False)
    check = graphs.verify(model, graph, transcoders, samples=graph.n_nodes)
    errors = range(graph.n_features, graph.n_features + graph.n_layers * graph.n_pos)
    assert check.ok and set(errors) <= set(check.sampled), check
    assert graph.cfg["in_errors"] == [["mlps.0", "mlps.1"]] * len(model.layers)  # (what a reader of the graph is told)
    labels = {node["clerp"] for node in graphs.graph_json(graph, "longcat", model.tokenizer, node_threshold=1.0,
                                                          edge_threshold=1.0)["nodes"]
              if node["feature_type"] == "mlp reconstruction error"}
    assert labels == {"MLP error + mlps.0 + mlps.1 outputs"}  # (the frontend's label of each error node)


def test_a_sublayer_without_its_gate_is_declined_by_name(monkeypatch):
    model = tiny_model("longcat_flash")
    entry = norm_gates.BLOCK_GATES["LongcatFlashDecoderLayer"]
    monkeypatch.setitem(norm_gates.BLOCK_GATES, "LongcatFlashDecoderLayer", {
        "last": tuple(gate for gate in entry["last"] if gate.module != "mlps.1")})
    reason = prove(model)
    assert reason is not None and "layers[0]'s sublayers mlps.1 have no transcoder and no block gate" in reason
