"""The linearity proof runs on transcoders reading where the graph's transcoders read (one proof per model and read
sites), so a read site no proof saw is proved before a graph of it is served (a remote graph's forward check:
tests/graphs/test_remote.py)."""

from __future__ import annotations

import weakref

import pytest

from nncanon import ValueNotAvailable, graphs
from nncanon.graphs import proof, replacement

from .conftest import PROMPT

OPTIONS = {"max_n_logits": 2, "max_feature_nodes": 6, "batch_size": 8}


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


def test_the_proof_names_the_first_block_not_affine(model, monkeypatch):
    """A curve on block 1's transcoder input alone: the proof's reason names layers[1] as where the frozen model is
    first not affine, block 0's input being affine (`nncanon.graphs.GraphCheck.block`)."""
    original = replacement._frozen_input

    def curved(model, layer, plan, clean, parts):
        x = original(model, layer, plan, clean, parts)
        return x + (x - clean.inputs[layer]) ** 2 if layer == 1 else x

    monkeypatch.setattr(replacement, "_frozen_input", curved)
    reason = proof.prove(model)  # (not graphs.support: the module's model keeps its proved line)
    assert reason is not None and "first at layers[1]'s transcoder input, layers[0]'s is)" in reason
