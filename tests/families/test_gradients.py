"""Gradients of every served value, on every registered variant (fp32).

Inside ``with loss.backward():`` of a trace, ``value.grad`` of each value a block serves equals the
gradient of the same logit with respect to the tensor at the value's site, computed with plain PyTorch
(`nncanon.proof.checks.gradient_reference`: tensor hooks and ``torch.autograd.grad`` on the unwrapped
model), laid out and scaled as the value is served. A write to ``value.grad`` (zeroed) equals the
plain model with that site's tensor detached.
"""

from __future__ import annotations

import pytest
import torch

from nncanon import GradientNotAvailable
from nncanon.proof.checks import encode, gradient_reference, host, served, site_module
from nncanon.served import _pick, _put, stacked_as_served
from nncanon.support import COMPONENTS, LAYER_VALUES
from nncanon.testing import PROMPTS

#: Every value a gradient can reach (``expert_indices`` are integers).
GRADIENT_VALUES = tuple(v for v in LAYER_VALUES if v not in COMPONENTS and v != "expert_indices")
TOL = dict(rtol=1e-5, atol=1e-6)
TOKEN = 5


#: RWKV's recurrent state is updated in place when it caches: no backward runs through it then.
NO_CACHE = dict(use_cache=False)


def _inputs(model) -> dict:
    return {**encode(model), **NO_CACHE}


def _target(model) -> tuple[int, int, int]:
    return (0, encode(model)["input_ids"].shape[1] - 1, TOKEN)


def _logit(model):
    target = _target(model)
    return lambda logits: logits[target]


def _gradients(model, layer: int, names: list[str]) -> dict:
    """``value.grad`` of each of ``names`` (in execution order) for ``logits[target]``, through nncanon."""
    target = _target(model)
    values: dict = {}
    grads: dict = {}
    with model.trace(PROMPTS[0], **NO_CACHE):
        for name in names:
            values[name] = getattr(host(model, layer, name), name)
        logit = model.logits[target]
        with logit.backward():
            for name in reversed(names):
                grads[name] = values[name].grad.save()
    return grads


def test_gradients_equal_autograd(model):
    for layer in range(model.num_layers):
        names = served(model, layer, GRADIENT_VALUES)
        ours = _gradients(model, layer, names)
        reference = gradient_reference(model, layer, names, _inputs(model), _logit(model))
        assert set(reference) <= set(names)
        for name in names:
            if name not in reference:  # the backward does not reach it in the plain model either
                assert not bool(ours[name].abs().any()), f"layers[{layer}].{name}"
                continue
            assert ours[name].shape == reference[name].shape, f"layers[{layer}].{name}"
            torch.testing.assert_close(ours[name], reference[name], **TOL, msg=f"layers[{layer}].{name}")


def _stream_gradient_with_site_detached(model, layer: int, name: str) -> torch.Tensor:
    """d logit / d (block 0's input) in the plain model, with ``name``'s site tensor on ``layer`` detached."""
    site = host(model, layer, name)._nncanon.bindings[name].site
    module = site_module(model, layer, name)
    first = site_module(model, 0, "layer_input")
    seen = {}

    def entering(mod, args, kwargs):
        seen["x"] = _pick((args, kwargs), type(site)(key="input"))
        seen["x"].register_hook(lambda grad: seen.__setitem__("grad", grad))

    if site.key == "input":
        cut = module.register_forward_pre_hook(
            lambda mod, args, kwargs: _put((args, kwargs), site, _pick((args, kwargs), site).detach()),
            with_kwargs=True)
    else:
        cut = module.register_forward_hook(lambda mod, args, output: _put(output, site, _pick(output, site).detach()))
    watch = first.register_forward_pre_hook(entering, with_kwargs=True)
    try:
        output = model._module(**_inputs(model))
        parameters = [p for p in model._module.parameters() if p.requires_grad]
        torch.autograd.grad(output.logits[_target(model)], parameters, allow_unused=True)
    finally:
        cut.remove()
        watch.remove()
    grad = seen.get("grad", torch.zeros_like(seen["x"]))  # zeros: no path left from the stream to the logit
    return stacked_as_served(grad) if model.family.stacked_streams else grad  # laid out as layer_input is served


def test_gradient_write_equals_detached_site(model):
    """``value.grad = 0`` on the last block equals the plain model with the value's site detached."""
    layer = model.num_layers - 1
    if layer == 0:
        pytest.skip("one block: the stream entering it is the only upstream")
    target = _target(model)
    for name in served(model, layer, GRADIENT_VALUES):
        binding = host(model, layer, name)._nncanon.bindings.get(name)
        if binding is None or binding.site.op is not None:  # no module hook reaches an operation site
            continue
        with model.trace(PROMPTS[0], **NO_CACHE):
            x = model.layers[0].layer_input
            value = getattr(host(model, layer, name), name)
            logit = model.logits[target]
            with logit.backward():
                value.grad = torch.zeros_like(value.grad)
                ours = x.grad.save()
        expected = _stream_gradient_with_site_detached(model, layer, name)
        torch.testing.assert_close(ours, expected, **TOL, msg=f"layers[{layer}].{name}")


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
    from nncanon.proof.checks import site_reference
    from nncanon.tools import attribution_patching, logit_difference

    metric = logit_difference(TOKEN, TOKEN + 1)
    clean = _inputs(model)
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
