"""The activation cache: one forward, every served value, keyed by the standard names."""

from __future__ import annotations

import torch

from nncanon.reading import CONTRIBUTIONS, EXECUTION_ORDER, read
from nncanon.testing import PROMPTS
from nncanon.tools import cache_activations

from .conftest import build


def test_cache_equals_values_read_one_by_one(model):
    cache = cache_activations(model, PROMPTS)
    report = model.support()
    served = [name for name in EXECUTION_ORDER if report.layers_with(name)]
    assert set(cache) == set(served)
    for name in served:
        for layer in report.layers_with(name):
            with torch.no_grad(), model.trace(PROMPTS):  # one value per trace: no order to follow
                expected = read(model, layer, name).save()
            assert torch.equal(cache[name][layer], expected), (name, layer)
    with torch.no_grad(), model.trace(PROMPTS):
        logits = model.logits.save()
    assert torch.equal(cache.logits, logits)


def test_cache_contribution_identity(model):
    asked = ["layer_output", "mlp_output", "layer_input", "linear_attention_output", "attention_output"]
    cache = cache_activations(model, PROMPTS[0], values=asked)
    names = list(cache)
    assert names[0] == "layer_input" and names[-1] == "layer_output"  # execution order
    for layer in range(model.num_layers):
        total = cache["layer_input"][layer] + sum(
            cache[name][layer] for name in CONTRIBUTIONS if name in cache and layer in cache[name]
        )
        torch.testing.assert_close(total, cache["layer_output"][layer], rtol=1e-5, atol=1e-5)
    assert cache.stack("layer_output").shape[0] == model.num_layers


def test_cache_skips_what_a_layer_declines():
    # DiffLlama pairs two softmax maps into one differential head: its probabilities are declined (on every
    # transformers minor; Falcon's ALiBi path under sdpa, this test's example before, is served from 5.25)
    model = build("diffllama")
    cache = cache_activations(model, PROMPTS[0], layers=[1])
    assert "attention_probabilities" not in cache and "router_logits" not in cache
    reason = model.support().reason("attention_probabilities", layer=1)
    assert "DiffLlama" in reason and cache.declined[("attention_probabilities", 1)] == reason
    assert set(cache["mlp_output"]) == {1}
    assert "router_logits" in repr(cache.declined)


def test_one_value_may_be_given_as_a_string():
    """values="mlp_output" was read letter by letter ("'m' is not a standard layer value")."""
    model = build("llama")
    one = cache_activations(model, PROMPTS[0], values="mlp_output")
    listed = cache_activations(model, PROMPTS[0], values=["mlp_output"])
    assert list(one) == ["mlp_output"]
    assert torch.equal(one.stack("mlp_output"), listed.stack("mlp_output"))
