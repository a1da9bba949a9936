"""Shared fixtures: every registry variant as a tiny model, and plain-PyTorch references."""

from __future__ import annotations

import pytest
import torch

from nncanon.registry import variants
from nncanon.testing import PROMPTS, tiny_model

VARIANTS = variants()
VARIANT_IDS = [v.name for v in VARIANTS]


@pytest.fixture(scope="module", params=VARIANTS, ids=VARIANT_IDS)
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def model(variant):
    """The variant's tiny model (eager attention, fp32), shared by one test module."""
    return tiny_model(variant)


def encode(model, prompt: str = PROMPTS[0]) -> dict:
    """Tokenize one prompt as the model's trace does (no padding)."""
    return dict(model.tokenizer(prompt, return_tensors="pt"))


def hf_block(model, index: int) -> torch.nn.Module:
    return model._module.get_submodule(model.family.layers)[index]
