"""A graph's traces run remotely like every nncanon trace: with nnsight's ``remote="local"`` simulation (the request
serialised and run with nncanon hidden on the "server"), the graph equals the local one bit for bit."""

from __future__ import annotations

import torch

from nncanon import graphs

from ..test_remote import _hosted, server_without_nncanon  # noqa: F401  (the fixture hiding nncanon)


def test_remote_graph_equals_local(tmp_path, monkeypatch, server_without_nncanon):  # noqa: F811
    model = _hosted("llama", tmp_path, monkeypatch)
    transcoders = graphs.random_transcoders(model, n_features=12, seed=3)
    options = {"max_n_logits": 3, "max_feature_nodes": 10, "batch_size": 16}
    local = graphs.attribute(model, "The cat sat on the mat", transcoders, **options)
    remote = graphs.attribute(model, "The cat sat on the mat", transcoders, remote="local", **options)
    for name in ("input_tokens", "active_features", "activation_values", "selected_features", "adjacency_matrix",
                 "logit_targets", "logit_probabilities"):
        assert torch.equal(getattr(remote, name), getattr(local, name)), name
    assert local.n_features == 10 and local.adjacency_matrix.abs().sum() > 0
