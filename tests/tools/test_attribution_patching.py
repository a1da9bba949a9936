"""attribution_patching's bad input, its labels and its batch axis (its values: tests/families/test_gradients.py)."""

from __future__ import annotations

import pytest
import torch

from nncanon.tools import attribution_patching, logit_difference

from .conftest import build

PROMPT = "The Eiffel Tower is in the city of"
METRIC = logit_difference(5, 6)


def test_bad_input_is_named():
    model = build("llama")
    with pytest.raises(ValueError, match="choose among"):
        attribution_patching(model, PROMPT, None, METRIC, over=("neurons",))
    with pytest.raises(ValueError, match="same length"):
        attribution_patching(model, PROMPT, "Berlin lies in", METRIC)
    with pytest.raises(ValueError, match="two prompts or two lists"):
        attribution_patching(model, PROMPT, [PROMPT], METRIC)


def test_a_batch_is_each_prompt_on_its_own():
    model = build("qwen3_next")
    prompts = [PROMPT, "Berlin lies in Germany"]
    both = attribution_patching(model, prompts, None, METRIC)
    assert both.batch and both.heads.shape[0] == 2
    # the hybrid's linear blocks stand for attention with their linear mixer
    assert set(both.values["attention"]) <= {"attention_output", "linear_attention_output"}
    assert "linear_attention_output" in both.values["attention"]
    for index, prompt in enumerate(prompts):
        alone = attribution_patching(model, [prompt], None, METRIC)
        for item in ("heads", "attention", "mlp"):
            torch.testing.assert_close(both[item][index], alone[item][0], rtol=1e-4, atol=1e-5, equal_nan=True)
    single = attribution_patching(model, PROMPT, None, METRIC, over=("mlp",))
    assert not single.batch and single.mlp.shape == (model.num_layers,)
    with pytest.raises(KeyError, match="was not estimated"):
        single["heads"]
    for parameter in model._module.parameters():
        assert parameter.grad is None and parameter.requires_grad, "the weights get no gradient, and keep requires_grad"
