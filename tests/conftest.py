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


def declined_as_recorded(model, variant) -> bool:
    """Whether this variant declines values, checked against its registry record, never silently.

    A record lists what a configuration cannot serve exactly (``"declines": ["attention_output", ...]``
    under ``"declined_variants"``). Returns ``True`` (the caller then stops: its identity cannot be
    asked of this layout) only after asserting that ``support()`` declines exactly those values on
    every layer and that reading them raises with the reason.
    """
    from nncanon.registry import records

    expected = set(records()[variant.model_type].get("declined_variants", {}).get(variant.name, []))
    report = model.support()
    for index in range(model.num_layers):
        declined = {
            value
            for value in ("attention_output", "mlp_output")
            if not report.available(value, layer=index)
        }
        assert declined == expected, f"layer {index}: support() declines {declined}, the record says {expected}"
        for value in declined:
            host = model.layers[index].self_attn if value == "attention_output" else model.layers[index].mlp
            with pytest.raises(AttributeError, match="not available"):
                with model.trace(PROMPTS[0]):
                    getattr(host, value)
    return bool(expected)


def encode(model, prompt: str = PROMPTS[0]) -> dict:
    """Tokenize one prompt as the model's trace does (no padding)."""
    return dict(model.tokenizer(prompt, return_tensors="pt"))


def hf_block(model, index: int) -> torch.nn.Module:
    return model._module.get_submodule(model.family.layers)[index]
