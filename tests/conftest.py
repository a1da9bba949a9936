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


#: The values a block adds to the residual stream; their sum is the block's update.
CONTRIBUTIONS = ("attention_output", "linear_attention_output", "mlp_output")
#: Per-head values, each on the component of the same kind.
HEAD_VALUES = ("attention_head_outputs", "linear_attention_head_outputs")


def host(model, index: int, value: str):
    """The component of block ``index`` that serves ``value``."""
    from nncanon.support import COMPONENT_OF

    return getattr(model.layers[index], COMPONENT_OF[value])


def served(model, index: int, values=CONTRIBUTIONS) -> list[str]:
    """The values of ``values`` that block ``index`` serves, per ``support()``."""
    report = model.support()
    return [value for value in values if report.available(value, layer=index)]


def declined_as_recorded(model, variant) -> bool:
    """Whether this variant declines contributions, checked against its registry record, never silently.

    A record lists what a configuration cannot serve exactly under ``"declined_variants"``
    (``{"bloom_residual_post_ln": ["attention_output", "mlp_output"]}``). A contribution is declined
    when its component is there but the value is not served; a component a block does not have
    (a Mamba block's ``self_attn``) is not a decline. Returns ``True`` (the caller then stops: the
    identity cannot be asked of this layout) only after asserting that ``support()`` declines exactly
    the recorded values on every layer and that reading them raises with the reason.
    """
    from nncanon.registry import records
    from nncanon.support import COMPONENT_OF

    expected = set(records()[variant.model_type].get("declined_variants", {}).get(variant.name, []))
    report = model.support()
    for index in range(model.num_layers):
        declined = {
            value
            for value in CONTRIBUTIONS
            if report.available(COMPONENT_OF[value], layer=index) and not report.available(value, layer=index)
        }
        assert declined == expected, f"layer {index}: support() declines {declined}, the record says {expected}"
        for value in declined:
            with pytest.raises(AttributeError, match="not available"):
                with model.trace(PROMPTS[0]):
                    getattr(host(model, index, value), value)
    return bool(expected)


def encode(model, prompt: str = PROMPTS[0]) -> dict:
    """Tokenize one prompt as the model's trace does (no padding)."""
    return dict(model.tokenizer(prompt, return_tensors="pt"))


def hf_block(model, index: int) -> torch.nn.Module:
    return model._module.get_submodule(model.family.layers)[index]
