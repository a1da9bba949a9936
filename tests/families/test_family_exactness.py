"""Exactness checks beyond the core invariants, on every registered family.

- bf16 write locality: a write at one position leaves every other position of the layer's
  output bit-identical to a clean run (also where the family scales its contributions);
- per-head decomposition: the heads, each through its slice of the output projection, plus
  the bias, sum to the projection's output;
- ``attention_head_outputs`` under sdpa equals eager; probabilities under sdpa raise.
"""

from __future__ import annotations

import pytest
import torch

from nncanon import ValueNotAvailable
from nncanon.registry import records
from nncanon.testing import PROMPTS, tiny_model

from ..conftest import CONTRIBUTIONS, HEAD_VALUES, declined_as_recorded, hf_block, host, served


def test_bf16_write_is_local(variant):
    model = tiny_model(variant, dtype=torch.bfloat16)
    if declined_as_recorded(model, variant):
        return
    position = 2
    for index in range(model.num_layers):
        layer = model.layers[index]
        with torch.no_grad(), model.trace(PROMPTS[0]):
            clean = layer.layer_output.save()
        for value in served(model, index, CONTRIBUTIONS):
            with torch.no_grad(), model.trace(PROMPTS[0]):
                getattr(host(model, index, value), value)[:, position] += 0.5
                written = layer.layer_output.save()
            others = [p for p in range(clean.shape[1]) if p != position]
            assert torch.equal(written[:, others], clean[:, others]), f"layer {index} {value}: other positions moved"
            assert not torch.equal(written[:, position], clean[:, position]), "the write must reach the stream"


def _projection(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W as [out, in], bias) of a linear output projection (nn.Linear or GPT-2's Conv1D)."""
    weight = module.weight
    if type(module).__name__ == "Conv1D":
        weight = weight.T
    return weight, module.bias


def test_heads_sum_to_projection(model):
    checked = 0
    for index in range(model.num_layers):
        for value in served(model, index, HEAD_VALUES):
            binding = host(model, index, value)._nncanon.bindings[value]
            projection = hf_block(model, index).get_submodule(binding.site.module)
            seen: dict = {}

            def keep(module, args, out, seen=seen):
                seen["out"] = out.clone()

            handle = projection.register_forward_hook(keep)
            try:
                with torch.no_grad(), model.trace(PROMPTS[0]):
                    heads = getattr(host(model, index, value), value).save()
            finally:
                handle.remove()
            weight, bias = _projection(projection)
            per_head = weight.view(weight.shape[0], heads.shape[-2], -1)  # [out, H, head_dim]
            total = torch.einsum("bshd,ohd->bso", heads, per_head)
            if bias is not None:
                total = total + bias
            torch.testing.assert_close(total, seen["out"].view_as(total), rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked or not any(
        layout.attention or layout.mixer_head_outputs for layout in model.family.all_layouts()
    ), "a family with heads must serve them somewhere"


def test_sdpa_heads_equal_eager_and_probabilities_decline(variant, model):
    if records()[variant.model_type].get("eager_only"):
        with pytest.raises(ValueError):
            tiny_model(variant, attn_implementation="sdpa")
        return
    sdpa = tiny_model(variant, attn_implementation="sdpa")
    assert sdpa.attn_implementation == "sdpa"
    attention_layers = model.support().layers_with("attention_head_outputs")
    eager_heads, sdpa_heads = [], []
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for index in attention_layers:
            eager_heads.append(model.layers[index].self_attn.attention_head_outputs.save())
    with torch.no_grad(), sdpa.trace(PROMPTS[0]):
        for index in attention_layers:
            sdpa_heads.append(sdpa.layers[index].self_attn.attention_head_outputs.save())
    for eager_value, sdpa_value in zip(eager_heads, sdpa_heads, strict=True):
        torch.testing.assert_close(sdpa_value, eager_value, rtol=1e-4, atol=1e-5)
    for index in attention_layers:
        assert not sdpa.support().available("attention_probabilities", layer=index)
        with pytest.raises(ValueNotAvailable, match="eager"):
            with sdpa.trace(PROMPTS[0]):
                sdpa.layers[index].self_attn.attention_probabilities
