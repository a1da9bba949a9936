"""Memory: the estimate printed before the rows run, the batch shrunk to fit, a named refusal with the estimate,
rows in a memory-mapped file (``offload="disk"``): the same graph every way."""

from __future__ import annotations

import pytest
import torch

from nncanon import InvalidArgument, graphs
from nncanon.graphs.memory import _sublayers, per_row_bytes
from nncanon.testing import tiny_model

from .conftest import PROMPT


@pytest.fixture(scope="module")
def reference(model, transcoders):
    return graphs.attribute(model, PROMPT, transcoders, max_n_logits=3, max_feature_nodes=20, batch_size=16)


def test_estimate_printed_and_batch_shrunk_to_fit(model, transcoders, reference, capsys):
    n_pos = reference.n_pos
    per_row = per_row_bytes(model, n_pos)
    n_cols = reference.n_nodes - reference.n_features + len(reference.active_features)
    rows = 4 * ((reference.n_features + reference.n_logits) * n_cols + reference.n_nodes ** 2)  # (the rows, the
    # adjacency of the selected nodes)
    limit = rows + 3 * per_row + per_row // 2  # room for the rows and 3 batch rows (the host is the device)
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=3, max_feature_nodes=20, batch_size=16,
                             verbose=True, memory_limit=limit)
    printed = capsys.readouterr().out
    assert "memory estimate" in printed and "3 rows" in printed
    assert graph.cfg["batch"] == 3 and reference.cfg["batch"] == 16
    same = graphs.attribute(model, PROMPT, transcoders, max_n_logits=3, max_feature_nodes=20, batch_size=3)
    assert torch.equal(graph.selected_features, same.selected_features)  # (the selection's order follows the batch)
    assert torch.equal(graph.adjacency_matrix, same.adjacency_matrix)


def test_refused_with_the_estimate(model, transcoders):
    with pytest.raises(graphs.GraphTooLarge, match=r"memory estimate: frozen forward .* available"):
        graphs.attribute(model, PROMPT, transcoders, memory_limit=10_000)
    with pytest.raises(MemoryError):  # (a MemoryError, for code that catches those)
        graphs.attribute(model, PROMPT, transcoders, memory_limit=10_000)


def test_estimate_grows_linearly_but_for_the_pattern(model):
    """Per batch row: linear in the positions except eager attention's heads · n² pattern."""
    heads = model.config.num_attention_heads
    layers = len(model.layers)
    size = 4  # float32
    for n in (16, 64, 256):
        quadratic = size * layers * 3 * heads * n * n
        assert (per_row_bytes(model, 2 * n) - 4 * quadratic) == 2 * (per_row_bytes(model, n) - quadratic)


def test_rows_on_disk_are_the_same_graph(model, transcoders, reference, tmp_path):
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=3, max_feature_nodes=20, batch_size=16,
                             offload="disk")
    assert torch.equal(graph.adjacency_matrix, reference.adjacency_matrix)
    graph.to_pt(tmp_path / "g.pt")
    assert torch.equal(graphs.Graph.from_pt(tmp_path / "g.pt").adjacency_matrix, reference.adjacency_matrix)
    with pytest.raises(InvalidArgument, match="offload"):
        graphs.attribute(model, PROMPT, transcoders, offload="gpu")


def test_estimate_counts_every_attention_and_mlp_of_a_block():
    """LongCat-Flash's blocks run two attentions and two dense MLPs beside the MoE: the pattern term is twice a
    one-attention block's and the MLP term holds the dense MLPs too."""
    model = tiny_model("longcat_flash")
    config = model.config.get_text_config()
    heads, layers, size, n = config.num_attention_heads, len(model.layers), 4, 16
    quadratic = (per_row_bytes(model, 2 * n) - 2 * per_row_bytes(model, n)) // (2 * n * n)
    assert quadratic == size * layers * 2 * 3 * heads
    assert _sublayers(model) == (2, 3)
    assert _sublayers(tiny_model("llama")) == (1, 1)
