"""Gradients (`Check.gradient`): they prove ``value.grad`` apart from the value.

- ``gradients``: ``value.grad`` of every served value, inside ``with logit.backward():``, equals the gradient
  plain PyTorch computes at the value's site (tensor hooks, ``torch.autograd.grad``).
- ``gradient_writes``: ``value.grad = 0`` equals the plain model with the value's site detached. Every value of
  the last block in one traced backward and one plain one, on a batch of the first prompt with one row per value
  (value ``i`` zeroed, its site detached, in row ``i`` only: the rows are independent, so each value's write is
  compared on its own); a value whose row does not hold there (or every value, where the batch raises) is checked
  alone, on the prompt alone, so that a failure is exactly its value's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from nnsight.intervention.util import first_input

from ...components.norms import NORM_VALUES
from ...errors import GradientNotAvailable
from ...reading import host
from ...served import _part, _pick, _put
from ..prompts import PROMPTS
from .base import (
    GRADIENT_ABSOLUTE,
    GRADIENT_TOLERANCE,
    GRADIENT_VALUES,
    KERNEL_INPUTS,
    NO_CACHE,
    CheckResult,
    compare,
    guarded,
)
from .gradient_references import gradient_inputs, gradient_references, gradient_target, gradients_at
from .references import hooks_removed, kernel_copies, served, site_module, stream_as_served

#: The values whose gradient is read at a site (the norms' are proved by `nncanon.proof.checks.norms`).
SITE_GRADIENT_VALUES = tuple(v for v in GRADIENT_VALUES if v not in NORM_VALUES)


def served_gradients(model: Any, names: dict[int, Sequence[str]]) -> dict[tuple[int, str], torch.Tensor]:
    """``value.grad`` of each value of ``names[layer]`` (each block's in execution order) for the logit
    `gradient_target`, through nncanon: one trace, one ``with logit.backward():`` block, the gradients asked
    in the reverse of the forward order. Keyed ``(layer, name)``.

    Raises:
        GradientNotAvailable: a gradient never arrived (and what else the trace raises).
    """
    target = gradient_target(model)
    values: dict = {}  # bound outside the trace, filled inside
    grads: dict = {}
    with torch.enable_grad(), model.trace(PROMPTS[0], **NO_CACHE):
        for layer, listed in names.items():
            for name in listed:
                values[layer, name] = getattr(host(model, layer, name), name)
        logit = model.logits[target]
        with logit.backward():
            for key in reversed(list(values)):
                grads[key] = values[key].grad.save()
    return grads


def with_gradient(model: Any, layer: int) -> list[str]:
    """The values of block ``layer`` that have a gradient to prove: every served value but the integer routing,
    and but the scores where they are recomputed beside the kernel (they are served without a gradient)."""
    names = served(model, layer, SITE_GRADIENT_VALUES)
    if "attention_scores" in names and not model.layers[layer].self_attn._eager():
        names.remove("attention_scores")
    return names


def check_gradients(model: Any) -> list[CheckResult]:
    """``value.grad`` of every served value, inside ``with logit.backward():``, equals the gradient of the
    same logit at the value's site by plain PyTorch (tensor hooks, ``torch.autograd.grad``), laid out and
    scaled as the value is served (kernel inputs served under another implementation only: on a copy running it)."""
    names = {layer: with_gradient(model, layer) for layer in range(model.num_layers)}
    results = _gradients(model, names)
    for other, layers in kernel_copies(model):  # kernel inputs served under another implementation only
        results += _gradients(other, {layer: served(other, layer, KERNEL_INPUTS) for layer in layers})
    return results


def _gradients(model: Any, names: dict[int, list[str]]) -> list[CheckResult]:
    """`check_gradients` of the values ``names[layer]`` of each block."""

    inputs = gradient_inputs(model)
    target = gradient_target(model)
    reference = gradient_references(model, names, inputs, lambda logits: logits[target])
    try:  # every value in one backward; where that fails, each value alone says which one
        ours: dict | None = served_gradients(model, names)
    except Exception:
        ours = None
    results = []
    for layer, listed in names.items():
        for name in listed:
            def run(layer: int = layer, name: str = name) -> list[CheckResult]:
                key = (layer, name)
                if ours is not None:
                    grad = ours[key]
                else:
                    try:
                        grad = served_gradients(model, {layer: [name]})[key]
                    except GradientNotAvailable:
                        grad = None
                return [_gradient_result(layer, name, grad, reference.get(key))]

            results += guarded("gradients", layer, (name,), run)
    return results


def _gradient_result(layer: int, name: str, grad: torch.Tensor | None, expected: torch.Tensor | None
                     ) -> CheckResult:
    """nncanon's gradient of ``name`` (``None``: it never arrived) against plain PyTorch's (``None``: the
    backward does not reach the site): one missing is a zero gradient."""
    if expected is None:
        error = 0.0 if grad is None else float(grad.detach().abs().max())
        note = "the backward does not reach it in the plain model" + (
            "" if grad is None else "; nncanon's gradient should be zero")
        return CheckResult("gradients", layer, (name,), error == 0.0, error, 0.0, note)
    if grad is None:
        return CheckResult("gradients", layer, (name,), False, float(expected.detach().abs().max()), GRADIENT_TOLERANCE,
                           "the backward never reached the served value; plain PyTorch's gradient is not zero")
    # The bar is relative to the value's largest gradient, as the norms' is: a backward's sums cancel (a value's
    # gradient through attention sums every query's), and their rounding is relative to the terms, not to the
    # element they leave (Exaone-4's value_states: 2 ulps of the largest gradient, 400 of a cancelled element).
    return compare("gradients", layer, (name,), grad, expected, GRADIENT_TOLERANCE,
                    "against tensor hooks at its site and torch.autograd.grad, relative to its largest gradient",
                    absolute=GRADIENT_ABSOLUTE, magnitude=_largest(expected))


def _largest(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s largest magnitude, broadcast to its shape (``None`` for an empty tensor)."""
    return tensor.detach().abs().amax().expand_as(tensor) if tensor.numel() else None


def check_gradient_writes(model: Any) -> list[CheckResult]:
    """``value.grad = 0`` on a value of the last block equals the plain model with the value's site detached:
    the gradient reaching the stream entering block 0 is the same."""
    layer = model.num_layers - 1
    names = [name for name in with_gradient(model, layer) if _detachable(model, layer, name)]
    try:  # every value in one backward, each on a row of its own; where that fails, each value alone
        together = _gradient_writes(model, layer, names) if len(names) > 1 else {}
    except Exception:
        together = {}
    results = []
    for name in names:
        shared = together.get(name)
        if shared is not None and shared.passed:
            results.append(shared)
        else:  # (failed or not run in the batch: alone, so that a failure is exactly this value's, as before)
            results += guarded("gradient_writes", layer, (name,), lambda name=name: list(
                _gradient_writes(model, layer, [name]).values()))
    return results


def _detachable(model: Any, layer: int, name: str) -> bool:
    """Whether a module hook detaches ``name``'s site (no hook detaches an operation's tensor or the
    probabilities; the stream of block 0 is what the check reads)."""
    binding = host(model, layer, name)._nncanon.bindings.get(name)
    return binding is not None and binding.site.op is None and not (layer == 0 and name == "layer_input")


def _gradient_writes(model: Any, layer: int, names: Sequence[str]) -> dict[str, CheckResult]:
    """`check_gradient_writes` of ``names`` (block ``layer``'s, in execution order) in one traced backward and one
    plain one: the first prompt once per value, value ``i``'s gradient zeroed in row ``i`` only (``value.grad = 0``
    where there is one value), against the plain model with value ``i``'s site detached in row ``i`` only. The
    rows are independent computations: each value's write is compared alone, on its own row. Keyed by name."""
    count = len(names)
    target = gradient_target(model)
    values: dict = {}  # bound outside the trace, filled inside
    with torch.enable_grad(), model.trace([PROMPTS[0]] * count, **NO_CACHE):
        stream = model.layers[0].layer_input
        for name in names:
            values[name] = getattr(host(model, layer, name), name)
        logit = model.logits[:, target[1], target[2]].sum()
        with logit.backward():
            for row in reversed(range(count)):
                value = values[names[row]]
                value.grad = _zeroed_row(value.grad, row, count)
            ours = stream.grad.save()
    expected = _stream_gradient_with_sites_detached(model, layer, names)
    together = "" if count == 1 else f" (each value zeroed in a row of its own of one batch of {count})"
    return {name: compare("gradient_writes", layer, (name,), ours.narrow(0, row, 1), expected.narrow(0, row, 1),
                          GRADIENT_TOLERANCE, "the stream's gradient against the plain model with the site detached"
                          + together, absolute=GRADIENT_ABSOLUTE)
            for row, name in enumerate(names)}


def _zeroed_row(grad: torch.Tensor, row: int, count: int) -> torch.Tensor:
    """``grad`` (a served value's, batch first) with row ``row`` of ``count`` zero, the others as they are."""
    if grad.shape[0] != count:
        raise ValueError(f"a gradient of {grad.shape[0]} rows where the batch has {count}")
    return grad.index_fill(0, torch.tensor([row], device=grad.device), 0)


def _detached(tensor: torch.Tensor, site: Any, row: int = 0, count: int = 1) -> torch.Tensor:
    """The site's tensor with the value's part detached (the whole tensor, but for a `Site.part`: that part), in
    row ``row`` of a batch of ``count`` only: the ``row``-th of ``count`` equal chunks of the batch axis (the first,
    or the second for `Site.stacked` streams; a `Site.flat` tensor's first axis is batch-major)."""
    axis = 1 if site.stacked else 0
    if tensor.shape[axis] % count:
        raise ValueError(f"the site's tensor has {tensor.shape[axis]} rows, not a multiple of the batch's {count}")
    if count == 1 and site.part is None:
        return tensor.detach()
    width = tensor.shape[axis] // count
    whole = tensor.clone()
    into, kept = whole.narrow(axis, row * width, width), tensor.narrow(axis, row * width, width)
    if site.part is not None:
        into, kept = _part(into, site.part), _part(kept, site.part)
    into.copy_(kept.detach())
    return whole


def _stream_gradient_with_sites_detached(model: Any, layer: int, names: Sequence[str]) -> torch.Tensor:
    """d logit / d (block 0's input) in the plain model on the first prompt once per value of ``names``, with
    ``names[i]``'s site tensor on ``layer`` detached in row ``i``; the sum of every row's logit is differentiated
    (the rows are independent: row ``i``'s gradient is its own logit's)."""
    count = len(names)
    seen: dict = {}

    def entering(mod: Any, args: Any, kwargs: Any) -> None:
        seen["x"] = first_input(args, kwargs)

    handles = []
    for row, name in enumerate(names):
        site = host(model, layer, name)._nncanon.bindings[name].site
        module = site_module(model, layer, name)
        if site.key == "input":
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, kwargs, site=site, row=row: _put(
                    (args, kwargs), site, _detached(_pick((args, kwargs), site), site, row, count)),
                with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(
                lambda mod, args, output, site=site, row=row: _put(
                    output, site, _detached(_pick(output, site), site, row, count))))
    handles.append(site_module(model, 0, "layer_input").register_forward_pre_hook(entering, with_kwargs=True))
    target = gradient_target(model)
    inputs = {key: torch.cat([value] * count) if isinstance(value, torch.Tensor) else value
              for key, value in gradient_inputs(model).items()}
    with hooks_removed(handles), torch.enable_grad():
        output = model._module(**inputs)
        if seen["x"].requires_grad:
            seen["grad"] = gradients_at(output, lambda logits: logits[:, target[1], target[2]].sum(), [seen["x"]])[0]
    grad = seen.get("grad")
    grad = torch.zeros_like(seen["x"]) if grad is None else grad  # (no path left from the stream to the logit)
    return stream_as_served(model, grad)  # laid out as layer_input is served
