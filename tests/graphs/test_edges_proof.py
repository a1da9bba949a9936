"""The checks a graph is served under, where they were missing: a remote graph's frozen forward is checked against
the clean run (its first request returns batch row 0's values), and the linearity proof runs on transcoders reading
where the graph's transcoders read (one proof per model and read sites), so a read site no proof saw is proved
before a graph of it is served."""

from __future__ import annotations

import weakref

import pytest

from nncanon import ValueNotAvailable, graphs
from nncanon.graphs import attribution, proof, replacement

from ..test_remote import _hosted, server_without_nncanon  # noqa: F401  (the fixture hiding nncanon)
from .conftest import PROMPT

OPTIONS = {"max_n_logits": 2, "max_feature_nodes": 6, "batch_size": 8}


def _broken_pattern(monkeypatch):
    """The frozen model's block-1 attention pattern written as the clean one scaled by 1.5: a frozen value that is
    not the clean run's, so the frozen forward is not the model's."""
    setup = attribution.setup

    def broken(*args, **kwargs):
        s = setup(*args, **kwargs)
        s.clean.frozen[1]["attention_probabilities"] = s.clean.frozen[1]["attention_probabilities"] * 1.5
        return s

    monkeypatch.setattr(attribution, "setup", broken)


def test_a_broken_frozen_value_fails_a_remote_graphs_forward_check(tmp_path, monkeypatch,
                                                                   server_without_nncanon):  # noqa: F811
    """Before, a remote graph's rows ran on the server and its forward was not checked: this graph was served (the
    local graph's check: tests/graphs/test_reads.py)."""
    model = _hosted("llama", tmp_path, monkeypatch)
    transcoders = graphs.random_transcoders(model, n_features=12, seed=3)
    assert graphs.support(model) is None  # (the proof, before the frozen value is broken)
    _broken_pattern(monkeypatch)
    with pytest.raises(ValueNotAvailable, match=r"on the frozen replacement model (the head's output|layers\[\d\]'s "
                                                r"transcoder input \(mlp_input\)) differs from the clean run's by "):
        graphs.attribute(model, PROMPT, transcoders, remote="local", **OPTIONS)


def _quadratic(monkeypatch, kind):
    """The frozen model reading ``kind`` as ``x + (x - clean)²``: its value and gradient at the clean run are the
    surface's, but it is not affine in the sources (a removal moves it by more than its edge)."""
    original = replacement._frozen_input

    def curved(model, layer, plan, clean, parts):
        x = original(model, layer, plan, clean, parts)
        return x + (x - clean.inputs[layer]) ** 2 if plan.reads[layer] == kind else x

    monkeypatch.setattr(replacement, "_frozen_input", curved)


def test_the_proof_covers_the_sites_the_transcoders_read(model, monkeypatch):
    monkeypatch.setattr(proof, "_PROVED", weakref.WeakKeyDictionary())
    proved = []
    prove = proof.prove
    monkeypatch.setattr(proof, "prove", lambda m, reads=None: proved.append(reads) or prove(m, reads))
    n = len(model.layers)
    mixed = ["resid_mid", "mlp_input"] * (n // 2) + ["resid_mid"] * (n % 2)
    _quadratic(monkeypatch, "resid_mid")
    default = graphs.random_transcoders(model, n_features=12, seed=3)
    graph = graphs.attribute(model, PROMPT, default, **OPTIONS)  # the MLP's input: the proof holds
    assert graph.cfg["reads"] == ["mlp_input"] * n and proved == [("mlp_input",) * n]
    assert model.support().graphs.startswith("yes")
    for reads in (["resid_mid"] * n, mixed):
        transcoders = graphs.random_transcoders(model, n_features=12, seed=3, reads=reads)
        with pytest.raises(ValueNotAvailable, match=r"transcoders reading resid_mid .* is not affine in the graph's "
                                                    r"sources .*completeness"):
            graphs.attribute(model, PROMPT, transcoders, **OPTIONS)
        assert proved[-1] == tuple(reads)
    with pytest.raises(ValueNotAvailable, match="not affine"):  # remembered: not proved again
        graphs.attribute(model, PROMPT, transcoders, **OPTIONS)
    assert len(proved) == 3
    graphs.attribute(model, PROMPT, default, **OPTIONS)
    assert len(proved) == 3 and model.support().graphs.startswith("yes")  # the default reads' line is unchanged


def test_each_read_site_kind_is_proved_on_the_model(model, monkeypatch):
    """Without the curve, every site the tiny Llama serves is proved (one small graph each) and its graph served."""
    monkeypatch.setattr(proof, "_PROVED", weakref.WeakKeyDictionary())
    n = len(model.layers)
    for kind in ("mlp_normalized", "resid_mid", "layer_input"):
        assert graphs.support(model, [kind] * n) is None, kind
        transcoders = graphs.random_transcoders(model, n_features=12, seed=3, reads=[kind] * n)
        graph = graphs.attribute(model, PROMPT, transcoders, **OPTIONS)
        assert graph.cfg["reads"] == [kind] * n and graphs.verify(model, graph, transcoders).ok
    assert set(proof._PROVED[model._module]) == {(kind,) * n for kind in ("mlp_normalized", "resid_mid",
                                                                          "layer_input")}
