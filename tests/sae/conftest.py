"""Tiny models the dictionary tests share (one of each per test module)."""

from __future__ import annotations

import pytest

from nncanon.testing import tiny_model


@pytest.fixture(scope="module")
def gpt2():
    return tiny_model("gpt2")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")
