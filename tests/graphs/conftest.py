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
