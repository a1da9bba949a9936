"""The MLP's neurons.

- ``neurons``: on every block serving them, three equalities between independent computations:
  ``activation(pre_activations) · linear_activations`` (through the MLP's hidden norm, where it has one; the
  family's own combination where it has one, `nncanon.families.MLPAnatomy.combine`) equals ``neurons``, the
  activation being the module the anatomy names or the config's; ``neurons`` through the down projection's weight
  (the dense matrix the neuron tools use, `nncanon.quantization.dense_weight`) plus its bias
  equals the down projection's output read by a plain hook; and zeroing one neuron at the last position
  (``neurons[:, -1, n] = 0``) gives the logits a plain forward pre-hook on the down projection gives when it
  zeroes that column there, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from ...components.anatomy import NEURON_VALUES, activation_of
from ...quantization import dense_weight
from ...reading import host
from ..prompts import PROMPTS
from .base import TOLERANCE, CheckResult, compare, guarded
from .references import encode, hf_block, served


def check_neurons(model: Any) -> list[CheckResult]:
    """activation(pre) · linear == neurons; neurons through the down projection's weight == its output; a neuron
    zeroed by its value == the same neuron zeroed by a plain pre-hook on the down projection (the logits)."""
    results = []
    for index in range(model.num_layers):
        names = served(model, index, NEURON_VALUES)
        if "neurons" not in names:
            continue
        results += guarded("neurons", index, names, lambda index=index, names=names: _neurons(model, index, names))
    return results


def _neurons(model: Any, index: int, names: list[str]) -> list[CheckResult]:
    mlp = host(model, index, "neurons")
    anatomy = mlp._nncanon.anatomy
    block = hf_block(model, index)
    down = block.get_submodule(anatomy.down)
    seen: dict = {}
    handle = down.register_forward_hook(lambda module, args, out: seen.__setitem__("down", out.clone()))
    saved = {}
    try:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            for name in names:
                saved[name] = getattr(mlp, name).save()
    finally:
        handle.remove()
    neurons = saved["neurons"]
    results = []
    if "pre_activations" in saved:
        activation = activation_of(block, anatomy, model._text_config)
        proves = tuple(name for name in names if name != "neurons")
        if anatomy.combine is not None:
            owner = block.get_submodule(anatomy.down.rpartition(".")[0])
            with torch.no_grad():
                hidden = anatomy.combine(owner, saved["pre_activations"], saved["linear_activations"])
            results.append(compare("neurons", index, proves, hidden, neurons, TOLERANCE,
                                   "the family's combination of pre and linear against the neurons"))
        elif activation is None:
            results.append(CheckResult("neurons", index, proves, False, None, None,
                                       "no activation: the MLP has no activation module and the config names none"))
        else:
            with torch.no_grad():
                hidden = activation(saved["pre_activations"])
                if "linear_activations" in saved:
                    hidden = hidden * saved["linear_activations"]
                if anatomy.hidden_norm is not None:
                    hidden = block.get_submodule(anatomy.hidden_norm)(hidden)
            results.append(compare("neurons", index, proves, hidden, neurons, TOLERANCE,
                                   "activation(pre) · linear against the neurons"))
    weight, bias = dense_weight(down), getattr(down, "bias", None)
    with torch.no_grad():
        through = neurons @ weight.to(neurons.dtype).T
        if bias is not None:
            through = through + bias.to(through.dtype)
    results.append(compare("neurons", index, ("neurons",), through, seen["down"].view_as(through), TOLERANCE,
                           f"the neurons through {anatomy.down}'s weight against its output"))
    results.append(_zeroed(model, index, down, neurons.shape[-1] - 1))
    return results


def _zeroed(model: Any, index: int, down: torch.nn.Module, neuron: int) -> CheckResult:
    """The logits with ``neuron`` zeroed at the last position by the served value and by a plain pre-hook."""
    with torch.no_grad(), model.trace(PROMPTS[0]):
        host(model, index, "neurons").neurons[:, -1, neuron] = 0
        served_logits = model.logits.save()
    inputs = encode(model)
    tokens = inputs["input_ids"].shape[-1]

    def zero(module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0].clone()
        rows = hidden.view(-1, tokens, hidden.shape[-1])  # (a flattened b·s axis, OPT's fc2, is split back)
        rows[:, -1, neuron] = 0
        return (hidden, *args[1:])

    handle = down.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            reference = model._module(**inputs).logits
    finally:
        handle.remove()
    return compare("neurons", index, ("neurons",), served_logits, reference, 0.0,
                   f"neuron {neuron} zeroed at the last position, against a plain pre-hook on the down projection")
