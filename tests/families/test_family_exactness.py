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

from ..conftest import (
    CONTRIBUTIONS,
    HEAD_VALUES,
    encode,
    hf_block,
    host,
    identity_layers,
    recorded_declines,
    served,
)
from .test_invariants import _site_reference


def test_bf16_write_is_local(variant):
    """A write at one position leaves every other position of the layer's output bit-identical.

    Where a later sublayer of the block reads the previous token (RWKV's channel mixing shifts tokens),
    the record lists the contributions it follows under ``"token_shift_after"``: a write there moves
    the next positions by the model's own computation, so only the earlier positions are compared.
    """
    model = tiny_model(variant, dtype=torch.bfloat16)
    shifted = set(records()[variant.model_type].get("token_shift_after", []))
    position = 2
    for index in identity_layers(model, variant):
        layer = model.layers[index]
        with torch.no_grad(), model.trace(PROMPTS[0]):
            clean = layer.layer_output.save()
        for value in served(model, index, CONTRIBUTIONS):
            with torch.no_grad(), model.trace(PROMPTS[0]):
                getattr(host(model, index, value), value)[:, position] += 0.5
                written = layer.layer_output.save()
            later = range(position + 1, clean.shape[1]) if value not in shifted else ()
            others = [*range(position), *later]
            assert torch.equal(written[:, others], clean[:, others]), f"layer {index} {value}: other positions moved"
            assert not torch.equal(written[:, position], clean[:, position]), "the write must reach the stream"


def _projection(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W as [out, in], bias) of a linear output projection (nn.Linear or GPT-2's Conv1D)."""
    weight = module.weight
    if type(module).__name__ == "Conv1D":
        weight = weight.T
    return weight, module.bias


def _moa_heads_total(model, index: int, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """JetMoE's mixture of attention heads: slot ``k``'s heads go through the output projection of the
    expert the token's attention router put in slot ``k``, times its gate, plus the bias. Returns the
    sum over heads and the attention's output, from a plain forward with hooks."""
    attention = hf_block(model, index).self_attention
    moa, seen = attention.experts, {}

    def keep(name, position):
        def hook(module, args, out):
            seen[name] = out[position].clone()

        return hook

    hooks = [
        moa.router.register_forward_hook(keep("logits", 4)),
        attention.register_forward_hook(keep("out", 0)),
    ]
    try:
        with torch.no_grad():
            model._module(**encode(model))
    finally:
        for hook in hooks:
            hook.remove()
    top_logits, experts = seen["logits"].topk(moa.top_k, dim=1)
    gates = torch.softmax(top_logits, dim=1)
    slots = heads.reshape(-1, moa.top_k, heads.shape[-2] // moa.top_k * heads.shape[-1])  # [tokens, k, kv·hd]
    total = moa.bias.expand(slots.shape[0], -1).clone()
    for slot in range(moa.top_k):
        weight = moa.output_linear.weight[experts[:, slot]]  # [tokens, d, kv·hd]
        total += gates[:, slot, None] * torch.einsum("td,tod->to", slots[:, slot], weight)
    return total.view_as(seen["out"]), seen["out"]


#: Families whose heads do not go through one output projection: (model, layer, heads) -> (sum, output).
HEAD_TOTALS = {"jetmoe": _moa_heads_total}


def test_heads_sum_to_projection(model):
    checked = 0
    for index in range(model.num_layers):
        for value in served(model, index, HEAD_VALUES):
            binding = host(model, index, value)._nncanon.bindings[value]
            if model.family.name in HEAD_TOTALS:
                with torch.no_grad(), model.trace(PROMPTS[0]):
                    heads = getattr(host(model, index, value), value).save()
                total, output = HEAD_TOTALS[model.family.name](model, index, heads)
                torch.testing.assert_close(total, output, rtol=1e-5, atol=1e-5)
                checked += 1
                continue
            spec = model.family.for_layer(model._text_config, index)[0]
            through_norm = value == "attention_head_outputs" and spec.head_norm is not None
            # Where a norm over all heads sits before the projection (BitNet), the heads are its input.
            module = spec.head_projection if through_norm else binding.site.module
            projection = hf_block(model, index).get_submodule(module)
            seen: dict = {}

            def keep(module, args, out, seen=seen):
                seen["out"] = out.clone()

            handle = projection.register_forward_hook(keep)
            try:
                with torch.no_grad(), model.trace(PROMPTS[0]):
                    heads = getattr(host(model, index, value), value).save()
            finally:
                handle.remove()
            if through_norm:
                with torch.no_grad():
                    heads = hf_block(model, index).get_submodule(spec.head_norm)(heads.flatten(-2)).view_as(heads)
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


def test_sdpa_heads_equal_hooks_and_eager_and_probabilities_decline(variant, model):
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
    # Under sdpa the heads are the projection's input, as plain hooks on the bare sdpa model read it.
    inputs = encode(sdpa)
    for index, sdpa_value in zip(attention_layers, sdpa_heads, strict=True):
        assert torch.equal(sdpa_value, _site_reference(sdpa, index, "attention_head_outputs", inputs))
    # And they equal eager's wherever transformers' own eager and sdpa forwards agree (they do not for
    # Falcon with ALiBi in 5.24, whose eager path adds ALiBi twice: see model_registry/falcon.json).
    with torch.no_grad():
        agree = torch.allclose(model._module(**inputs).logits, sdpa._module(**inputs).logits, rtol=1e-4, atol=1e-5)
    if agree:
        for eager_value, sdpa_value in zip(eager_heads, sdpa_heads, strict=True):
            torch.testing.assert_close(sdpa_value, eager_value, rtol=1e-4, atol=1e-5)
    else:
        assert "upstream_issues" in records()[variant.model_type], "eager and sdpa differ in transformers itself"
    for index in attention_layers:
        assert not sdpa.support().available("attention_probabilities", layer=index)
        # Declined under sdpa for want of eager, unless the family declines them outright (DiffLlama).
        reason = "eager" if "attention_probabilities" not in recorded_declines(variant, index) else "not available"
        with pytest.raises(ValueNotAvailable, match=reason):
            with sdpa.trace(PROMPTS[0]):
                sdpa.layers[index].self_attn.attention_probabilities
