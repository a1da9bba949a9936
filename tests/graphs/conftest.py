"""Fixtures of the graph tests: the tiny Llama (eager attention) and the prompt most of them trace."""

from __future__ import annotations

import pytest

from nncanon import graphs
from nncanon.testing import tiny_model

PROMPT = "The cat sat on the mat"


@pytest.fixture(scope="module")
def model():
    """The tiny Llama (every test module gets it once)."""
    return tiny_model("llama")


@pytest.fixture(scope="module")
def transcoders(model):
    """Random ReLU transcoders of the tiny Llama, one per block."""
    return graphs.random_transcoders(model, n_features=12, seed=3)


def assert_exact_graph(model, name: str, forward: float = 1e-5) -> None:
    """``graphs.support(model)`` is ``None`` and the graph of `PROMPT` over random transcoders is one
    `nncanon.graphs.verify` proves (4 sampled edges), its forward within ``forward`` of the clean run's."""
    assert graphs.support(model) is None, f"{name}: {graphs.support(model)}"
    transcoders = graphs.random_transcoders(model, n_features=12, seed=1)
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=3, max_feature_nodes=20, batch_size=16)
    check = graphs.verify(model, graph, transcoders, samples=4)
    assert check.ok, f"{name}: {check}"
    assert check.forward < forward
