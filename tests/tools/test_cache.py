"""The activation cache: one forward, every served value, keyed by the standard names."""

from __future__ import annotations

import torch

from nncanon.testing import PROMPTS
from nncanon.tools import cache_activations

from .conftest import build


def test_cache_equals_values_read_one_by_one(model):
    cache = cache_activations(model, PROMPTS)
    assert set(cache) == {
        "layer_input", "attention_probabilities", "attention_head_outputs", "attention_output", "mlp_output",
        "layer_output",
    }
    for layer in range(model.num_layers):
        expected = {}  # bound outside the trace
        with torch.no_grad(), model.trace(PROMPTS):
            block = model.layers[layer]
            expected["layer_input"] = block.layer_input.save()
            expected["attention_probabilities"] = block.self_attn.attention_probabilities.save()
            expected["attention_head_outputs"] = block.self_attn.attention_head_outputs.save()
            expected["attention_output"] = block.self_attn.attention_output.save()
            expected["mlp_output"] = block.mlp.mlp_output.save()
            expected["layer_output"] = block.layer_output.save()
        for name, value in expected.items():
            assert torch.equal(cache[name][layer], value), (name, layer)
    with torch.no_grad(), model.trace(PROMPTS):
        logits = model.logits.save()
    assert torch.equal(cache.logits, logits)


def test_cache_contribution_identity(model):
    asked = ["layer_output", "mlp_output", "layer_input", "attention_output"]
    cache = cache_activations(model, PROMPTS[0], values=asked)
    assert list(cache) == ["layer_input", "attention_output", "mlp_output", "layer_output"]  # execution order
    for layer in range(model.num_layers):
        total = cache["layer_input"][layer] + cache["attention_output"][layer] + cache["mlp_output"][layer]
        torch.testing.assert_close(total, cache["layer_output"][layer], rtol=1e-5, atol=1e-5)
    assert cache.stack("layer_output").shape[0] == model.num_layers


def test_cache_skips_what_a_layer_declines():
    model = build("llama", attn_implementation="sdpa")
    cache = cache_activations(model, PROMPTS[0], layers=[1])
    assert "attention_probabilities" not in cache and "router_logits" not in cache
    assert "eager" in cache.declined[("attention_probabilities", 1)]
    assert set(cache["mlp_output"]) == {1}
    assert "router_logits" in repr(cache.declined)
