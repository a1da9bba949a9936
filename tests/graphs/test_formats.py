"""circuit-tracer's formats: its transcoder sets load as the same transcoders; the graph JSON its frontend reads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from nncanon import InvalidDictionary, graphs


def _write_set(folder, transcoders, reads="mlp.hook_in", writes="hook_mlp_out", npz=False):
    lines = ['model_name: "tiny"', f'feature_input_hook: "{reads}"', f"feature_output_hook: '{writes}'",
             "transcoders:"]
    for layer, t in enumerate(transcoders):
        if npz:
            name = f"layer_{layer}.npz"
            np.savez(folder / name, W_enc=t.W_enc.numpy(), W_dec=t.W_dec.numpy(), b_enc=t.b_enc.numpy(),
                     b_dec=t.b_dec.numpy(), threshold=t.threshold.numpy())
        else:
            name = f"layer_{layer}.safetensors"
            layer_weights = {"W_enc": t.W_enc.T.contiguous(), "W_dec": t.W_dec.contiguous(), "b_enc": t.b_enc,
                             "b_dec": t.b_dec}  # circuit-tracer's SingleLayerTranscoder.to_safetensors layout
            if t.threshold is not None:
                layer_weights["activation_function.threshold"] = t.threshold
            save_file(layer_weights, folder / name)
        lines += [f'  - id: "t{layer}"', f"    layer: {layer}", f'    filepath: "{name}"']
    (folder / "set.yaml").write_text("\n".join(lines) + "\n")
    return folder / "set.yaml"


@pytest.mark.parametrize("npz,jump", [(False, False), (False, True), (True, True)],
                         ids=["relu-safetensors", "jumprelu-safetensors", "gemmascope-npz"])
def test_circuit_tracer_set_loads_as_the_same_transcoders(model, tmp_path, npz, jump):
    original = graphs.random_transcoders(model, n_features=12, seed=2, threshold=0.05 if jump else None)
    loaded = graphs.load_transcoders(_write_set(tmp_path, original, npz=npz))
    for a, b in zip(original, loaded, strict=True):
        assert b.cfg.architecture == ("jumprelu_transcoder" if jump else "transcoder")
        for name, tensor in a.state_dict().items():
            assert torch.equal(tensor, getattr(b, name)), name
    one = graphs.attribute(model, "The cat sat", original, max_n_logits=2)
    two = graphs.attribute(model, "The cat sat", loaded, max_n_logits=2)
    assert torch.equal(one.adjacency_matrix, two.adjacency_matrix)


def test_circuit_tracer_mlp_hooks_and_bad_sets(model, tmp_path):
    original = graphs.random_transcoders(model, n_features=12)
    loaded = graphs.load_transcoders(_write_set(tmp_path, original, reads="mlp.hook_in", writes="mlp.hook_out"))
    assert loaded[1].cfg.hook_name == "blocks.1.mlp.hook_in"
    # ln2.hook_normalized (the norm's input before its weight, circuit-tracer's Gemma-2 sets) is read as such
    normalized = graphs.load_transcoders(_write_set(tmp_path, original, reads="ln2.hook_normalized"))
    graph = graphs.attribute(model, "The cat", normalized)
    assert graph.cfg["reads"] == ["mlp_normalized"] * len(model.layers)
    assert graphs.verify(model, graph, normalized, samples=3).ok
    resid = graphs.load_transcoders(_write_set(tmp_path, original, reads="hook_attn_out"))
    with pytest.raises(InvalidDictionary, match="reads layers"):
        graphs.attribute(model, "The cat", resid)
    with pytest.raises(InvalidDictionary, match="does not exist"):
        graphs.load_transcoders(tmp_path / "nothing.yaml")
    (tmp_path / "bad.yaml").write_text("transcoders: 3\n")
    with pytest.raises(InvalidDictionary, match="not a circuit-tracer transcoder config"):
        graphs.load_transcoders(tmp_path / "bad.yaml")
    (tmp_path / "remote.yaml").write_text('feature_input_hook: "ln2.hook_normalized"\nfeature_output_hook: '
                                          '"hook_mlp_out"\ntranscoders:\n  - {id: a, layer: 0, filepath: '
                                          '"hf://x/layer_0.safetensors"}\n')
    with pytest.raises(InvalidDictionary, match="remote"):
        graphs.load_transcoders(tmp_path / "remote.yaml")


def test_graph_json(model, tmp_path):
    transcoders = graphs.random_transcoders(model, n_features=12, seed=4)
    graph = graphs.attribute(model, "The cat sat on the mat", transcoders, max_n_logits=3)
    path = graphs.write_graph_json(graph, tmp_path, "cat", model.tokenizer)
    record = json.loads(path.read_text())
    assert set(record) == {"metadata", "qParams", "nodes", "links"}
    ids = [node["node_id"] for node in record["nodes"]]
    assert len(ids) == len(set(ids))
    assert all(link["source"] in ids and link["target"] in ids for link in record["links"])
    kinds = {node["feature_type"] for node in record["nodes"]}
    assert {"embedding", "logit"} <= kinds
    assert sum(node["feature_type"] == "embedding" for node in record["nodes"]) == graph.n_pos
    assert [n["is_target_logit"] for n in record["nodes"] if n["feature_type"] == "logit"].count(True) == 1
    keep = graphs.prune(graph)
    assert len(record["links"]) <= int(keep.edge_mask.sum())
    for link in record["links"][:20]:  # a link's weight is the adjacency entry of its nodes
        target = next(n for n in record["nodes"] if n["node_id"] == link["target"])
        assert isinstance(link["weight"], float) and target["feature_type"] != "embedding"
    listing = json.loads((tmp_path / "graph-metadata.json").read_text())
    assert [g["slug"] for g in listing["graphs"]] == ["cat"]
    assert record["metadata"]["prompt_tokens"] and record["metadata"]["prompt"] == graph.input_string
