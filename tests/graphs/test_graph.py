"""The graph record, attribution's options, pruning and scores, and bad input, on the tiny Llama."""

from __future__ import annotations

import pytest
import torch

from nncanon import InvalidArgument, InvalidDictionary, InvalidInput, StandardizedTransformer, graphs
from nncanon.sae import Dictionary
from nncanon.testing import tiny_hf_model, tiny_tokenizer

from .conftest import PROMPT


@pytest.fixture(scope="module")
def graph(model, transcoders):
    return graphs.attribute(model, PROMPT, transcoders, max_n_logits=3)


def test_save_load_round_trip(graph, tmp_path):
    path = tmp_path / "graph.pt"
    graph.to_pt(path)
    loaded = graphs.Graph.from_pt(path)
    for name in ("input_tokens", "active_features", "activation_values", "selected_features", "adjacency_matrix",
                 "logit_targets", "logit_probabilities"):
        assert torch.equal(getattr(loaded, name), getattr(graph, name)), name
    assert loaded.n_layers == graph.n_layers and loaded.input_string == graph.input_string
    assert torch.equal(torch.load(path, weights_only=False)["logit_tokens"], graph.logit_targets)  # 0.4's name


def test_node_order(graph, model):
    n_pos = len(graph.input_tokens)
    assert graph.error_node(0, 0) == graph.n_features
    assert graph.error_node(1, 2) == graph.n_features + n_pos + 2
    assert graph.token_node(0) == graph.n_features + len(model.layers) * n_pos
    assert graph.logit_node(graph.n_logits - 1) == graph.n_nodes - 1
    assert len(graph.selected_features) == len(graph.active_features)  # every feature without max_feature_nodes


def test_selected_rows_are_the_full_graphs(model, transcoders, graph):
    """max_feature_nodes keeps the most influential features; their rows are the full graph's, restricted."""
    part = graphs.attribute(model, PROMPT, transcoders, max_n_logits=3, max_feature_nodes=10, batch_size=4)
    assert part.n_features == 10
    columns = torch.cat([part.selected_features, torch.arange(graph.n_features, graph.n_nodes)])
    rows = torch.cat([part.selected_features, torch.arange(graph.n_nodes - graph.n_logits, graph.n_nodes)])
    expected = graph.adjacency_matrix[rows][:, columns]
    got = torch.cat([part.adjacency_matrix[:10], part.adjacency_matrix[-part.n_logits:]])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    influence = graphs.node_influence(graph)[: graph.n_features]
    assert set(part.selected_features.tolist()) & set(influence.topk(3).indices.tolist())


def test_jumprelu_and_skip_transcoders_are_exact(model):
    torch.manual_seed(0)
    hidden = model.config.hidden_size
    base = graphs.random_transcoders(model, n_features=12, seed=5, threshold=0.05)
    assert all(t.cfg.activation == "jumprelu" for t in base)
    skip = [Dictionary.from_tensors(t.W_enc, t.b_enc, t.W_dec, t.b_dec, architecture="skip_transcoder",
                                    hook_name=t.cfg.hook_name, hook_name_out=t.cfg.hook_name_out,
                                    W_skip=torch.randn(hidden, hidden) * 0.05) for t in base]
    for set_ in (base, skip):
        graph = graphs.attribute(model, PROMPT, set_, max_n_logits=2)
        check = graphs.verify(model, graph, set_, samples=4)
        assert check.ok, str(check)


def test_missing_layers_are_all_error(model, transcoders):
    graph = graphs.attribute(model, PROMPT, {1: transcoders[1]}, max_n_logits=2)
    assert set(graph.active_features[:, 0].tolist()) <= {1}
    assert graphs.verify(model, graph, {1: transcoders[1]}, samples=4).ok


def test_prune_and_scores(graph):
    result = graphs.prune(graph, node_threshold=0.8, edge_threshold=0.98)
    assert result.node_mask.shape == (graph.n_nodes,) and result.edge_mask.shape == (graph.n_nodes,) * 2
    assert result.node_mask[-graph.n_logits - graph.n_pos:].all()             # tokens and logits kept
    assert not result.edge_mask[~result.node_mask].any() and not result.edge_mask[:, ~result.node_mask].any()
    assert result.node_mask[: graph.n_features].sum() < graph.n_features      # something pruned
    everything = graphs.prune(graph, node_threshold=1.0, edge_threshold=1.0)
    assert everything.node_mask.sum() >= result.node_mask.sum()
    ordered = result.cumulative_scores.sort().values
    assert 0 < ordered[0] and abs(float(ordered[-1]) - 1.0) < 1e-5
    replacement, completeness = graphs.graph_scores(graph)
    assert 0 < replacement < 1 and 0 < completeness < 1
    with pytest.raises(InvalidArgument, match="node_threshold"):
        graphs.prune(graph, node_threshold=1.5)


def test_scores_without_errors_are_one(graph):
    """A graph whose error nodes carry nothing scores 1 on both (circuit-tracer's definitions)."""
    clean = graphs.Graph(**{**graph.__dict__, "adjacency_matrix": graph.adjacency_matrix.clone()})
    clean.adjacency_matrix[:, graph.n_features:graph.token_node(0)] = 0
    assert graphs.graph_scores(clean) == pytest.approx((1.0, 1.0))


def test_bad_input(model, transcoders):
    other = graphs.random_transcoders(model)
    wide = [Dictionary.from_tensors(torch.randn(64, 4), None, torch.randn(4, 64), None, architecture="transcoder")
            for _ in model.layers]
    with pytest.raises(InvalidDictionary, match="trained on another model"):
        graphs.attribute(model, PROMPT, wide)
    with pytest.raises(InvalidDictionary, match="2 blocks and 1 transcoders"):
        graphs.attribute(model, PROMPT, other[:1])
    shifted = [other[1], other[0]]
    with pytest.raises(InvalidDictionary, match=r"reads layers\.0\.mlp_input"):
        graphs.attribute(model, PROMPT, shifted)
    bad = other[0].state_dict()
    bad["W_enc"] = bad["W_enc"].clone()
    bad["W_enc"][0, 0] = float("nan")
    with pytest.raises(InvalidDictionary, match="NaN"):  # refused where it is made, before any graph
        Dictionary.from_tensors(bad["W_enc"], bad["b_enc"], bad["W_dec"], bad["b_dec"], architecture="transcoder")
    with pytest.raises(InvalidInput, match="empty"):
        graphs.attribute(model, "", transcoders)
    with pytest.raises(InvalidInput, match="empty"):
        graphs.attribute(model, [], transcoders)
    with pytest.raises(InvalidArgument, match="offload"):
        graphs.attribute(model, PROMPT, transcoders, offload="gpu")


def test_feature_columns_blockwise_are_the_whole_products_bit_for_bit(model, transcoders, graph, monkeypatch):
    from nncanon.graphs import attribution

    g, positions, vectors = torch.randn(3, 7, 16), torch.tensor([0, 0, 2, 5, 6, 6, 1]), torch.randn(7, 16)
    whole = (g[:, positions] * vectors[None]).sum(-1)
    for block in (1, 48, 1 << 18):  # a column a block, several, all at once
        monkeypatch.setattr(attribution, "DOTS_BLOCK", block)
        assert torch.equal(attribution._dots(g, positions, vectors), whole), block
    monkeypatch.setattr(attribution, "DOTS_BLOCK", 1)
    again = graphs.attribute(model, PROMPT, transcoders, max_n_logits=3)
    assert torch.equal(again.adjacency_matrix, graph.adjacency_matrix)


def test_support_is_held_while_a_graph_is_built_and_released_after(model, transcoders):
    """`support_held` hands out one report, made on entry (nested blocks share it), and lets go on exit, an error
    included; the report it holds says what a fresh one says."""
    with model.support_held() as held:
        assert model.support() is held
        with model.support_held() as inner:
            assert inner is held
        assert model.support() is held
    assert model.support() is not held
    assert model.support().to_dict() == held.to_dict()
    with pytest.raises(InvalidInput):
        graphs.attribute(model, "", transcoders)
    assert model.support() is not model.support()  # (nothing held after a graph that failed)


def test_a_model_loaded_from_a_folder_is_proved_before_its_first_trace(tmp_path):
    """A model loaded by path is built on meta and loads its weights at its first trace; a block whose MLP module's
    output a transcoder writes (Doge's is not a sum of contributions) is asked what that module returns, which must
    be asked of the loaded modules: the graph is proved at once, not declined as "it did not run"."""
    folder = tmp_path / "doge"
    tiny_hf_model("doge").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    model = StandardizedTransformer(str(folder), attn_implementation="eager")
    assert not model.dispatched
    assert graphs.support(model) is None
