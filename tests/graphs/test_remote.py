"""A graph's traces run remotely like every nncanon trace: with nnsight's ``remote="local"`` simulation (the request
serialised and run with nncanon hidden on the "server"), the graph equals the local one bit for bit, and its frozen
forward is checked against the clean run as a local graph's is (the first request returns batch row 0's values); a QK
attribution's traces too (four requests), its record the local one bit for bit."""

from __future__ import annotations

import pytest
import torch
from nnsight.intervention.backends.local import LocalSimulationBackend

from nncanon import ValueNotAvailable, graphs
from nncanon.graphs import attribution

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
    # a frozen value that is not the clean run's (block 1's pattern scaled by 1.5): the remote graph's forward check
    # fails with the numbers (before, a remote graph's rows ran on the server unchecked, and this graph was served)
    setup = attribution.setup

    def broken(*args, **kwargs):
        s = setup(*args, **kwargs)
        s.clean.frozen[1]["attention_probabilities"] = s.clean.frozen[1]["attention_probabilities"] * 1.5
        return s

    monkeypatch.setattr(attribution, "setup", broken)
    with pytest.raises(ValueNotAvailable, match=r"on the frozen replacement model (the head's output|layers\[\d\]'s "
                                                r"transcoder input \(mlp_input\)) differs from the clean run's by "):
        graphs.attribute(model, "The cat sat on the mat", transcoders, remote="local", **options)


def test_remote_qk_attribution_equals_local(tmp_path, monkeypatch, server_without_nncanon):  # noqa: F811
    """Every trace of a QK attribution (the clean run, the query and key read, the frozen forward of its copies and
    their backward, the check's trace) runs remotely, and the record is the local one bit for bit."""
    model = _hosted("llama", tmp_path, monkeypatch)
    transcoders = graphs.random_transcoders(model, n_features=12, seed=3)
    graph = graphs.attribute(model, "The cat sat on the mat", transcoders, max_n_logits=2, max_feature_nodes=10,
                             batch_size=16)
    local = graphs.qk_attribution(model, graph, transcoders, 1, 1, 5, 3)
    requests, hide = [], LocalSimulationBackend._hide_local_modules  # (the fixture's: called once per request)
    monkeypatch.setattr(LocalSimulationBackend, "_hide_local_modules", lambda self: requests.append(1) or hide(self))
    remote = graphs.qk_attribution(model, graph, transcoders, 1, 1, 5, 3, remote="local")
    assert len(requests) == 4  # the graph's clean run, the query and key read, the frozen forward, the check's
    for name in ("query", "key", "query_bias", "key_bias", "frozen_query", "frozen_key", "removed_query",
                 "removed_key"):
        assert torch.equal(getattr(remote, name), getattr(local, name)), name
    assert (remote.score, remote.scaling, remote.sampled) == (local.score, local.scaling, local.sampled)
    assert remote.check.ok and local.query.abs().sum() > 0 and len(local.sampled) == 4
