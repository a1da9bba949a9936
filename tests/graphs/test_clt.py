"""Cross-layer transcoders: each feature of layer ``s`` writes to every layer ``l >= s``'s MLP output; error node
``(l, pos)`` = the MLP's output − every reconstruction into ``l``. Proved exact (`graphs.verify`), equal to hand
arithmetic, and circuit-tracer's safetensors layout read and written."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from nncanon import InvalidDictionary, graphs
from nncanon.graphs.attribution import setup
from nncanon.sae import Dictionary, value_at
from nncanon.testing import tiny_model

PROMPT = "The cat sat on the mat"


@pytest.mark.parametrize("variant, hook, threshold, skip", [
    ("llama", "hook_resid_mid", None, False), ("gemma2", "ln2.hook_normalized", 0.05, False),
    ("gpt2", "mlp.hook_in", None, True), ("qwen3", "hook_resid_mid", 0.05, True)])
def test_clt_graph_is_exact(variant, hook, threshold, skip):
    model = tiny_model(variant)
    clt = graphs.random_clt(model, n_features=10, seed=1, threshold=threshold, feature_input_hook=hook, skip=skip)
    graph = graphs.attribute(model, PROMPT, clt, max_n_logits=2, max_feature_nodes=24, batch_size=8)
    check = graphs.verify(model, graph, clt, samples=6)
    assert check.ok, f"{variant}: {check}"
    assert graph.n_nodes == graph.n_features + (len(model.layers) + 1) * graph.n_pos + graph.n_logits


def test_clt_errors_are_the_mlp_output_less_every_reconstruction():
    model = tiny_model("llama")
    clt = graphs.random_clt(model, n_features=10, seed=2)
    s = setup(model, PROMPT, clt, max_n_logits=2, zero_bos=False)
    n_layers = len(model.layers)
    xs, outs = [], []
    with torch.no_grad(), model.trace(s.ids):
        for layer in range(n_layers):
            xs.append(value_at(model, f"blocks.{layer}.hook_resid_mid").save())
            outs.append(model.layers[layer].mlp.mlp_output.save())
    features = [torch.relu(xs[layer][0] @ clt.W_enc[layer] + clt.b_enc[layer]) for layer in range(n_layers)]
    for layer in range(n_layers):
        recon = clt.b_dec[layer] + sum(features[src] @ clt.W_dec[src][:, layer - src] for src in range(layer + 1))
        torch.testing.assert_close(s.errors[layer], outs[layer][0] - recon, rtol=1e-5, atol=1e-6)
    # a source's vectors: activation · W_dec[s][f, r] into layer s + r, zero past the last layer
    for (layer, _pos, feature), value, vectors in zip(s.active.tolist(), s.values, s.sources, strict=True):
        assert vectors.shape == (n_layers, model.config.hidden_size)
        torch.testing.assert_close(vectors[: n_layers - layer], value * clt.W_dec[layer][feature])
        assert not vectors[n_layers - layer:].any()


def test_clt_without_cross_decoders_is_the_per_layer_graph():
    """A CLT whose decoders into later layers are zero is a per-layer transcoder set: the same graph."""
    model = tiny_model("llama")
    clt = graphs.random_clt(model, n_features=10, seed=3, feature_input_hook="mlp.hook_in")
    for w in clt.W_dec:
        w[:, 1:] = 0
    per_layer = [Dictionary.from_tensors(clt.W_enc[layer], clt.b_enc[layer], clt.W_dec[layer][:, 0],
                                         clt.b_dec[layer], architecture="transcoder",
                                         hook_name=f"blocks.{layer}.mlp.hook_in",
                                         hook_name_out=f"blocks.{layer}.hook_mlp_out")
                 for layer in range(len(model.layers))]
    one = graphs.attribute(model, PROMPT, clt, max_n_logits=2)
    two = graphs.attribute(model, PROMPT, per_layer, max_n_logits=2)
    assert torch.equal(one.active_features, two.active_features)
    torch.testing.assert_close(one.adjacency_matrix, two.adjacency_matrix, rtol=1e-5, atol=1e-6)


def test_circuit_tracer_clt_layout_round_trip(tmp_path):
    model = tiny_model("llama")
    clt = graphs.random_clt(model, n_features=10, seed=4, threshold=0.05)
    config = graphs.save_clt(clt, tmp_path / "clt")
    first = load_file(str(tmp_path / "clt" / "W_enc_0.safetensors"))
    assert first["W_enc_0"].shape == (10, model.config.hidden_size)                 # [d_transcoder, d_model]
    assert set(first) == {"W_enc_0", "b_enc_0", "b_dec_0", "threshold_0"}
    assert load_file(str(tmp_path / "clt" / "W_dec_1.safetensors"))["W_dec_1"].shape == (10, 1, 32)
    loaded = graphs.load_transcoders(config)
    assert isinstance(loaded, graphs.CrossLayerTranscoder)
    for name, tensor in clt.tensors().items():
        assert torch.equal(tensor, loaded.tensors()[name]), name
    one = graphs.attribute(model, PROMPT, clt, max_n_logits=2)
    two = graphs.attribute(model, PROMPT, loaded, max_n_logits=2)
    assert torch.equal(one.adjacency_matrix, two.adjacency_matrix)


def test_bad_clts(tmp_path):
    model = tiny_model("llama")
    clt = graphs.random_clt(model, n_features=10)
    other = graphs.CrossLayerTranscoder(torch.randn(2, 16, 10), torch.zeros(2, 10),
                                        [torch.randn(10, 2 - s, 16) for s in range(2)], torch.zeros(2, 16))
    with pytest.raises(InvalidDictionary, match="trained on another model"):
        graphs.attribute(model, PROMPT, other)
    nan = graphs.random_clt(model, n_features=10)
    nan.W_dec[1][0, 0, 0] = float("nan")
    with pytest.raises(InvalidDictionary, match="NaN"):
        graphs.attribute(model, PROMPT, nan)
    wrong = graphs.random_clt(model, n_features=10)
    wrong.W_dec[0] = wrong.W_dec[0][:, :1]
    with pytest.raises(InvalidDictionary, match=r"W_dec\[0\]"):
        graphs.attribute(model, PROMPT, wrong)
    with pytest.raises(InvalidDictionary, match="no W_enc"):
        graphs.load_clt(tmp_path)
    graphs.save_clt(clt, tmp_path / "clt")
    (tmp_path / "clt" / "W_dec_1.safetensors").unlink()
    with pytest.raises(InvalidDictionary, match="W_dec_1"):
        graphs.load_clt(tmp_path / "clt")
