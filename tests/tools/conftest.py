"""The tools' tests run on tiny llama and gpt2, gemma2, bloom, granite and the Qwen3-Next hybrid (linear-attention
and attention blocks, a mixture of experts) where registered."""

from __future__ import annotations

from functools import cache

import pytest

import nncanon
from nncanon.registry import variants
from nncanon.testing import tiny_model

WANTED = ("llama", "gpt2", "gemma2", "bloom", "granite", "qwen3_next")
_NAMES = {v.name for v in variants(available=True)}
FAMILIES = [name for name in WANTED if name in nncanon.registered_model_types() and name in _NAMES]


@cache
def build(name: str, **options) -> nncanon.StandardizedTransformer:
    """One tiny model per (variant, options) for the whole session: the tools never change weights."""
    return tiny_model(name, **options)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def model(family):
    return build(family)


def attention_layers(model) -> list[int]:
    """The blocks with softmax attention (a hybrid's others have a linear mixer)."""
    return model.support().layers_with("attention_output")
