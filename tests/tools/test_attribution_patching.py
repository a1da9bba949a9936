"""attribution_patching's bad input, its labels and its batch axis (its values: tests/families/test_gradients.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

import nncanon
from nncanon import GradientNotAvailable
from nncanon.study import MIXERS, target_token
from nncanon.tools import OVER, activation_patching, attribution_patching, logit_difference, run_metric

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
    with pytest.raises(GradientNotAvailable, match="does not depend on layers"):
        attribution_patching(model, PROMPT, None, lambda logits: torch.ones(len(logits), requires_grad=True))


def _same_length(model, prompt: str) -> str:
    """``prompt`` with another place in it, of the same token length."""
    length = len(model.tokenizer(prompt).input_ids)
    for place in ("Belem", "Madrid", "Berlin", "London", "Tokyo", "Rome"):
        other = prompt.replace("Eiffel", place)
        if len(model.tokenizer(other).input_ids) == length:
            return other
    raise AssertionError(f"no place gives {prompt!r}'s length")


def test_next_token_only_is_the_same_estimate(model):
    """With the last position's logits only, a metric of the next token gets the same estimates."""
    for corrupted in (None, _same_length(model, PROMPT)):
        every = attribution_patching(model, PROMPT, corrupted, METRIC)
        last = attribution_patching(model, PROMPT, corrupted, METRIC, next_token_only=True)
        for item in OVER:
            torch.testing.assert_close(last[item], every[item], rtol=1e-4, atol=1e-6, equal_nan=True)


def test_the_head_backward_for_the_metrics_logits_only_equals_torchs(model, monkeypatch):
    """The unembedding's backward restricted to the logits the metric depends on (a logit difference: two
    columns) equals torch's own backward through the head (the tool with the restriction turned off), on every
    position's logits and the last one's; a metric of every logit (log-softmax) takes torch's backward."""
    tool = importlib.import_module("nncanon.tools.attribution_patching")  # (the function shadows the module)
    corrupted = _same_length(model, PROMPT)
    metrics = {"logit difference": METRIC, "log P": lambda logits: logits[:, -1].log_softmax(-1)[:, 5]}
    cases = [(metric, other, last) for metric in metrics.values() for other in (None, corrupted)
             for last in (False, True)]
    restricted = [attribution_patching(model, PROMPT, other, metric, next_token_only=last)
                  for metric, other, last in cases]
    assert tool._linear_head(model) is not None, "every family here has a torch.nn.Linear head"
    monkeypatch.setattr(tool, "_linear_head", lambda model: None)
    for (metric, other, last), ours in zip(cases, restricted, strict=True):
        torchs = attribution_patching(model, PROMPT, other, metric, next_token_only=last)
        for item in OVER:
            torch.testing.assert_close(ours[item], torchs[item], rtol=1e-5, atol=1e-6, equal_nan=True)


def _ranks(values: torch.Tensor) -> torch.Tensor:
    return values.argsort().argsort().double()


@pytest.mark.parametrize("name", ["gpt2", "llama", "hybrid"])
def test_the_estimate_ranks_heads_as_exact_patching_does_on_the_demo_models(name):
    """The headline figure of the benchmarks page: on the demo prompt patched from a prompt of the same length
    (logit difference of the two answers), the estimates of every layer's heads rank as the exact patching
    effects (`activation_patching` of each head from the corrupted run into the clean one): Spearman >= 0.9."""
    model = nncanon.demo_model(name)
    clean, corrupted = PROMPT, "The Belem Tower is in the city of"
    metric = logit_difference(target_token(model, " Paris"), target_token(model, " Lisbon"))
    estimate = attribution_patching(model, clean, corrupted, metric, over=("heads",))
    base = run_metric(model, clean, metric)
    exact, estimated = [], []
    for _, _, value in MIXERS:
        layers = [layer for layer, served in enumerate(estimate.values["heads"]) if served == value]
        if layers:
            effects = activation_patching(model, corrupted, clean, value, layers, positions=None, heads="each",
                                          metric=metric) - base
            exact.append(effects.flatten())
            estimated.append(estimate.heads[layers, : effects.shape[1]].flatten())
    exact, estimated = torch.cat(exact), torch.cat(estimated)
    assert len(exact) == int((~estimate.heads.isnan()).sum())
    spearman = torch.corrcoef(torch.stack([_ranks(exact), _ranks(estimated)]))[0, 1]
    assert spearman >= 0.9, f"{name}: Spearman {float(spearman):.3f}"


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
