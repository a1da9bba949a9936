"""Quantized layers and gradients.

- ``quantized_gradients``: every quantized linear layer passes the gradient to its input that its weight gives:
  ``d sum(layer(x)) / dx`` equals the column sums of its dequantized weight. Where one does not (bitsandbytes'
  4-bit CPU kernel once it has repacked its weights), no served value's gradient is whole, and ``.grad`` is
  declined with the layer and the numbers. A model without quantized layers has nothing to check.
"""

from __future__ import annotations

from typing import Any

import torch

from ...quantization import dense_weight, is_quantized
from ...support import COMPONENTS, LAYER_VALUES
from .base import GRADIENT_ABSOLUTE, GRADIENT_TOLERANCE, CheckResult, compare, guarded


def check_quantized_gradients(model: Any) -> list[CheckResult]:
    """Every quantized linear layer passes its weight's gradient to its input (``d sum(layer(x))/dx`` against the
    column sums of its dequantized weight); where one does not, the gradient of every served value is in doubt."""
    layers = [(name, module) for name, module in model._module.named_modules() if is_quantized(module)]
    if not layers:
        return []
    failures = []
    measured = 0.0
    for name, module in layers:
        result = guarded("quantized_gradients", None, (name,), lambda module=module, name=name: [
            _passes(module, name)])[0]
        measured = max(measured, result.error or 0.0)
        if not result.passed:
            failures.append(result)
    report = model.support()
    results = []
    for layer in range(model.num_layers):
        values = tuple(v for v in LAYER_VALUES if v not in COMPONENTS and v != "expert_indices"
                       and report.available(v, layer=layer))
        if not values:
            continue
        if failures:
            first = failures[0]
            note = (f"{len(failures)} of {len(layers)} quantized layers pass no whole gradient to their input; "
                    f"{first.values[0]}: {first.note or 'wrong gradient'}")
            results.append(CheckResult("quantized_gradients", layer, values, False, first.error, first.tolerance,
                                       note))
        else:
            results.append(CheckResult("quantized_gradients", layer, values, True, measured, GRADIENT_TOLERANCE,
                                       f"the input gradients of all {len(layers)} quantized layers"))
    return results


def _passes(module: torch.nn.Module, name: str) -> CheckResult:
    """``module``'s input gradient for ``sum(module(x))`` on a random ``x`` against its dequantized weight's column
    sums, ``[in_features]`` per row."""
    weight = dense_weight(module)  # [out, in]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, weight.shape[1], generator=generator).to(weight.dtype).requires_grad_(True)
    with torch.enable_grad():
        y = module(x)
        (grad,) = torch.autograd.grad(y.float().sum(), x, allow_unused=True)
    name = f"{name} ({type(module).__name__})"
    if grad is None:
        return CheckResult("quantized_gradients", None, (name,), False, None, None,
                           "its output has no gradient path to its input")
    expected = weight.float().sum(0).expand_as(grad).to(grad.dtype)
    return compare("quantized_gradients", None, (name,), grad, expected, GRADIENT_TOLERANCE,
                   "the input gradient against the dequantized weight's column sums", absolute=GRADIENT_ABSOLUTE)
