"""Gradients of served values on every registered variant (fp32): what is not a check.

The gradient checks themselves (``value.grad`` against plain PyTorch's gradient at the value's site, a
write to ``value.grad`` against the plain model with the site detached) are the verifier's
(`nncanon.proof.checks.check_gradients`, ``check_gradient_writes``): they run with every other check in
``test_invariants.py::test_check_holds``, at load on a twin of the user's config, and on inferred families.
Here: the named errors, and attribution patching (a tool) against the plain model's first-order term.
"""

from __future__ import annotations

import pytest
import torch

from nncanon import GradientNotAvailable
from nncanon.proof.checks.base import GRADIENT_TOKEN, GRADIENT_VALUES, NO_CACHE
from nncanon.proof.checks.gradient_references import gradient_inputs, gradient_reference
from nncanon.proof.checks.references import encode, served
from nncanon.reading import host
from nncanon.testing import PROMPTS


def test_gradient_errors_are_named(model):
    names = served(model, 0, GRADIENT_VALUES)
    name = names[-1]
    with pytest.raises(GradientNotAvailable, match=r"forward part of the trace"):
        with model.trace(PROMPTS[0]):
            getattr(host(model, 0, name), name).grad
    with pytest.raises(GradientNotAvailable, match=r"read inside `with loss.backward\(\):`"):
        with model.trace(PROMPTS[0]):
            loss = model.logits.sum()
            with loss.backward():
                getattr(host(model, 0, name), name).grad.save()
    with pytest.raises(GradientNotAvailable, match="never reached"):
        with model.trace(PROMPTS[0]):
            x = model.layers[0].layer_input
            value = model.layers[model.num_layers - 1].layer_output
            loss = x.sum()
            with loss.backward():
                value.grad.save()


def _corrupted(model) -> str | None:
    """A prompt of the clean prompt's token length that names another place (``None`` if none has it)."""
    length = len(model.tokenizer(PROMPTS[0]).input_ids)
    for place in ("Berlin", "London", "Madrid", "Tokyo", "Lisbon", "Vienna", "Prague", "Rome"):
        prompt = PROMPTS[0].replace("Eiffel", place)
        if len(model.tokenizer(prompt).input_ids) == length:
            return prompt
    return None


def test_attribution_patching_is_the_first_order_term(model):
    """Each head's and sublayer's estimate equals ``Σ (a_corrupted - a_clean) · ∂metric/∂a`` computed on the
    plain model (site hooks, ``torch.autograd.grad``); with no corrupted prompt, ``a_corrupted = 0``."""
    from nncanon.proof.checks.references import site_reference
    from nncanon.tools import attribution_patching, logit_difference

    metric = logit_difference(GRADIENT_TOKEN, GRADIENT_TOKEN + 1)
    clean = gradient_inputs(model)
    corrupted = _corrupted(model)
    for other in dict.fromkeys([None, corrupted]):
        result = attribution_patching(model, PROMPTS[0], other, metric)
        patched = {**encode(model, other), **NO_CACHE} if other is not None else None
        for layer in range(model.num_layers):
            names = {item: result.values[item][layer] for item in ("heads", "attention", "mlp")}
            present = [name for name in names.values() if name]
            reference = gradient_reference(model, layer, present, clean, lambda logits: metric(logits).sum())
            for item, name in names.items():
                estimate = result[item][layer]
                if name is None:
                    assert bool(estimate.isnan().all()), f"layers[{layer}] {item}"
                    continue
                value = site_reference(model, layer, name, clean)
                source = site_reference(model, layer, name, patched) if patched else torch.zeros_like(value)
                grad = reference.get(name, torch.zeros_like(value))
                product = (source - value).double() * grad.double()
                expected = product.sum(dim=(1, -1))[0] if item == "heads" else product.sum()
                if item == "heads":
                    assert bool(estimate[expected.numel():].isnan().all()), f"layers[{layer}]: heads past its count"
                    estimate = estimate[: expected.numel()]
                torch.testing.assert_close(estimate.double(), expected,
                                           rtol=1e-4, atol=1e-6, msg=f"layers[{layer}] {item} ({name}), {other!r}")
