"""Where a transcoder reads (``mlp.hook_in``, ``ln2.hook_normalized``, ``hook_resid_mid``), the token nodes at
``model.token_embeddings`` and attention gates frozen: every graph proved (`graphs.verify`: forward == clean, rows
sum to their targets, sampled removals == columns), and each read equal to an independent computation."""

from __future__ import annotations

import pytest
import torch

from nncanon import InvalidDictionary, ValueNotAvailable, graphs
from nncanon.graphs import replacement
from nncanon.graphs.attribution import setup
from nncanon.sae import Dictionary, value_at
from nncanon.testing import tiny_model

PROMPT = "The cat sat on the mat"


def _at(transcoders, name):
    """The same weights reading ``blocks.L.<name>``."""
    return [Dictionary.from_tensors(t.W_enc, t.b_enc, t.W_dec, t.b_dec, architecture="transcoder",
                                    hook_name=f"blocks.{layer}.{name}", hook_name_out=t.cfg.hook_name_out)
            for layer, t in enumerate(transcoders)]


@pytest.mark.parametrize("variant, name", [("llama", "ln2.hook_normalized"), ("gpt2", "ln2.hook_normalized"),
                                           ("gemma2", "ln2.hook_normalized"),
                                           ("gpt_neox_parallel", "ln2.hook_normalized"), ("llama", "hook_resid_mid"),
                                           ("gpt2", "hook_resid_mid"), ("gpt_neox_parallel", "hook_mlp_in"),
                                           ("qwen3", "hook_resid_pre")])
def test_reads_are_the_surface_values_and_exact(variant, name):
    model = tiny_model(variant)
    transcoders = _at(graphs.random_transcoders(model, n_features=12, seed=6), name)
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=2, max_feature_nodes=16)
    check = graphs.verify(model, graph, transcoders, samples=4)
    assert check.ok, f"{variant} {name}: {check}"
    # each feature's activation is its transcoder's on the value a plain trace reads at the name (the name table)
    saved = []
    with torch.no_grad(), model.trace(graph.input_tokens[None]):
        for layer in range(len(model.layers)):
            saved.append(value_at(model, f"blocks.{layer}.{name}").save())
    for (layer, pos, feature), value in zip(graph.active_features.tolist(), graph.activation_values, strict=True):
        expected = transcoders[layer].encode(saved[layer][0, pos])[feature]
        torch.testing.assert_close(value, expected.float(), rtol=1e-5, atol=1e-6)


def test_normalized_is_the_mlp_input_with_the_weight_folded():
    """On an RMSNorm without offset or bias, a transcoder at ln2.hook_normalized with encoder ``W`` is one at
    mlp.hook_in with encoder ``W / weight``: the same graph (two code paths: the frozen stream over the clean scale,
    and the MLP module's input)."""
    model = tiny_model("llama")
    base = graphs.random_transcoders(model, n_features=12, seed=7)
    normalized = _at(base, "ln2.hook_normalized")
    folded = [Dictionary.from_tensors(t.W_enc / layer.post_attention_layernorm.weight.detach()[:, None], t.b_enc,
                                      t.W_dec, t.b_dec, architecture="transcoder", hook_name=t.cfg.hook_name,
                                      hook_name_out=t.cfg.hook_name_out)
              for t, layer in zip(base, model._module.model.layers, strict=True)]
    one = graphs.attribute(model, PROMPT, normalized, max_n_logits=2)
    two = graphs.attribute(model, PROMPT, folded, max_n_logits=2)
    assert torch.equal(one.active_features, two.active_features)
    torch.testing.assert_close(one.adjacency_matrix, two.adjacency_matrix, rtol=1e-4, atol=1e-5)


def test_refused_reads():
    model = tiny_model("gpt_neox_parallel")
    parallel = _at(graphs.random_transcoders(model), "hook_resid_mid")
    with pytest.raises(InvalidDictionary, match="parallel block"):
        graphs.attribute(model, PROMPT, parallel)
    llama = tiny_model("llama")
    with pytest.raises(InvalidDictionary, match=r"reads layers\.0\.mlp_input or layers\.0\.mlp_normalized"):
        graphs.attribute(llama, PROMPT, _at(graphs.random_transcoders(llama), "hook_resid_post"))


@pytest.mark.parametrize("variant", ["gpt2", "llama", "gemma2", "granite", "bloom"])
def test_token_nodes(variant):
    """The token nodes are model.token_embeddings (the family's embedding scale placement; BLOOM, whose embedding
    norm is no frozen value: the stream into block 0); absolute positions are in every target's bias; removing
    every token node moves each target by its token columns' sum."""
    model = tiny_model(variant)
    transcoders = graphs.random_transcoders(model, n_features=12, seed=8)
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=2, max_feature_nodes=12)
    expected = "layer_input" if variant == "bloom" else "token_embeddings"
    assert graph.cfg["tokens"] == expected
    site, vectors = model.layers[0] if expected == "layer_input" else model, []
    with torch.no_grad(), model.trace(graph.input_tokens[None]):
        vectors.append(getattr(site, expected).save())
    s = setup(model, graph.input_tokens, transcoders, max_n_logits=2)
    assert torch.equal(s.clean.embeddings, vectors[0][0])
    tokens = list(range(graph.token_node(0), graph.token_node(0) + graph.n_pos))
    check = graphs.verify(model, graph, transcoders, samples=graph.n_nodes)  # every source, tokens included
    assert check.ok and set(tokens) <= set(check.sampled), str(check)


def test_attention_gate_is_frozen():
    """AFMoE's output gate (sigmoid of the stream) is written back with the clean run's: the graph is exact."""
    model = tiny_model("afmoe")
    assert graphs.support(model) is None
    transcoders = graphs.random_transcoders(model, n_features=12, seed=9)
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=2, max_feature_nodes=16)
    assert all("attention_gate" in frozen for frozen in graph.cfg["frozen"])
    check = graphs.verify(model, graph, transcoders, samples=6)
    assert check.ok, str(check)


def test_every_graph_checks_its_forward(monkeypatch):
    """Each graph compares the frozen model's transcoder inputs with the surface's values of the clean run (its first
    batch row has every leaf clean): a read computed otherwise is refused with the numbers, never a graph."""
    model = tiny_model("llama")
    transcoders = _at(graphs.random_transcoders(model, n_features=12, seed=11), "ln2.hook_normalized")
    graphs.support(model)  # (the model's proof first, unaffected)

    def doubled(anatomy, x):
        return x.float() * 2, None
    monkeypatch.setattr(replacement, "statistics", doubled)
    with pytest.raises(ValueNotAvailable, match=r"transcoder input \(mlp_normalized\) differs from the clean run's"):
        graphs.attribute(model, PROMPT, transcoders, max_n_logits=2)
