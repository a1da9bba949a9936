"""A dense MLP's anatomy: which of its projections hold the pre-activation, the linear path and the neurons.

`discover` reads it from the MLP module's structure, by widths: the down projection maps ``d_mlp`` features to the
stream's width, and the projections that read the stream produce ``d_mlp`` features (two of them, or one fused
projection producing ``2·d_mlp``, in a gated MLP). Names break a tie only where the widths cannot (``gate_proj``
and ``up_proj`` have the same shape; a square MLP's down projection, ``d_mlp`` equal to the stream's width). What it
proposes is a `MLPAnatomy`; the load-time proof checks it
(`nncanon.proof.checks.neurons`), so a wrong guess is a declined value with the check's numbers, never a wrong one.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.activations import ACT2FN

from ..families.base import MLPAnatomy
from ..quantization import _features
from ..served import Site

#: The values an anatomy serves, by standard name: the pre-activation, the linear path, the neurons.
NEURON_VALUES = ("pre_activations", "linear_activations", "neurons")

#: The names a down projection has where its widths do not tell it from the MLP's other projections.
DOWN_NAMES = ("down_proj", "fc2", "c_proj", "w2", "wo", "dense_4h_to_h", "fc_out", "out_proj")


def linear_widths(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a linear layer (``nn.Linear`` and its quantized subclasses, GPT-2's
    ``Conv1D`` whose weight is ``[in, out]``), ``None`` for any other module."""
    if type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor):
        return int(module.weight.shape[0]), int(module.nf)
    if isinstance(module, torch.nn.Linear):
        out_features, in_features = _features(module)
        return in_features, out_features
    return None


def _is_activation(module: torch.nn.Module) -> bool:
    cls = type(module)
    return (cls.__module__.startswith(("transformers.activations", "torch.nn.modules.activation"))
            or any(word in cls.__name__ for word in ("Activation", "Gelu", "GELU", "SiLU", "ReLU")))


def discover(mlp: torch.nn.Module, prefix: str, hidden: int) -> MLPAnatomy | str:
    """The anatomy of ``mlp`` (a dense MLP module, or a block that runs its MLP inline), its paths relative to the
    block (``prefix``: the MLP's own path there, ``""`` for a block), or why none is found.

    ``hidden`` is the width of the stream the MLP reads and writes.
    """
    at = (lambda name: f"{prefix}.{name}") if prefix else (lambda name: name)
    linears = {name: widths for name, child in mlp.named_children() if (widths := linear_widths(child)) is not None}
    owner = type(mlp).__name__
    # The down projection: back to the stream's width, from a width the stream's readers produce (or twice it).
    downs = [name for name, (width_in, width_out) in linears.items() if width_out == hidden
             and any(other != name and w_in == hidden and w_out in (width_in, 2 * width_in)
                     for other, (w_in, w_out) in linears.items())]
    if len(downs) > 1:  # a square MLP (d_mlp == the stream's width): the name tells
        downs = [name for name in downs if name.lower() in DOWN_NAMES or "down" in name.lower()]
    if len(downs) != 1:
        found = ", ".join(f"{n} {w[0]}->{w[1]}" for n, w in linears.items()) or "none"
        return (f"its MLP ({owner}) has no one down projection to the stream's width {hidden} fed by a projection "
                f"of the stream (linear layers: {found})")
    down = downs[0]
    width = linears[down][0]
    readers = [name for name, (w_in, w_out) in linears.items() if name != down and w_in == hidden]
    plain = [name for name in readers if linears[name][1] == width]
    fused = [name for name in readers if linears[name][1] == 2 * width]
    activations = [name for name, child in mlp.named_children() if _is_activation(child)]
    activation = at(activations[0]) if len(activations) == 1 else None
    if len(plain) == 1 and not fused:
        return MLPAnatomy(down=at(down), pre=at(plain[0]), activation=activation)
    if len(plain) == 2 and not fused:
        gates = [name for name in plain if "gate" in name.lower()]
        if len(gates) != 1:
            return (f"its MLP ({owner}) has two projections of the stream of the same width ({', '.join(plain)}) "
                    "and neither is named as the gate")
        up = next(name for name in plain if name != gates[0])
        return MLPAnatomy(down=at(down), pre=at(gates[0]), linear=at(up), activation=activation)
    if len(fused) == 1 and not plain:
        return MLPAnatomy(down=at(down), pre=at(fused[0]), linear=at(fused[0]), fused=at(fused[0]),
                          activation=activation)
    return (f"its MLP ({owner}) has {len(plain)} projections of the stream to {width} features and {len(fused)} "
            f"to {2 * width}: no one gate and linear path")


def neuron_sites(anatomy: MLPAnatomy, block: torch.nn.Module, other: torch.nn.Module | None = None
                 ) -> dict[str, Site]:
    """The sites of `NEURON_VALUES` an anatomy of ``block``'s MLP serves (no ``linear_activations`` for an MLP
    without a linear path).

    The pre-activation is what the activation module receives where the MLP calls one (after whatever the MLP does
    to the projection's output first: Falcon-H1's ``gate_multiplier``, Gemma-3n's activation sparsity), else the
    projection's output; also where the activation module is one object every block calls (OpenAI-GPT's, from a
    dict of instances): ``other`` is another block of the same layout, to tell.
    """
    sites = {"neurons": Site(anatomy.down, key="input", flat=anatomy.flat)}
    activation = anatomy.activation if anatomy.activation is not None and _has(block, anatomy.activation) else None
    if activation is not None and other is not None and _has(other, activation) and (
            other.get_submodule(activation) is block.get_submodule(activation)):
        activation = None  # shared by the blocks: its input is every block's
    if activation is not None:
        sites["pre_activations"] = Site(activation, key="input", flat=anatomy.flat)
    if anatomy.linear_op is not None:
        operation, index = anatomy.linear_op
        sites["linear_activations"] = Site(anatomy.linear, op=operation, index=index)
    if anatomy.fused is not None:
        first, second = anatomy.fused_order
        sites.setdefault("pre_activations", Site(anatomy.fused, part=(first, 2)))
        sites.setdefault("linear_activations", Site(anatomy.fused, part=(second, 2)))
    else:
        sites.setdefault("pre_activations", Site(anatomy.pre, flat=anatomy.flat))
        if anatomy.linear is not None:
            sites.setdefault("linear_activations", Site(anatomy.linear, flat=anatomy.flat))
    return {name: sites[name] for name in NEURON_VALUES if name in sites}


def _has(block: torch.nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def activation_of(block: torch.nn.Module, anatomy: MLPAnatomy, config: Any) -> Any:
    """The activation an anatomy names (a module of ``block``, or one of transformers' by name); else the config's
    ``hidden_act`` (``hidden_activation``), which the proof then checks; ``None`` where nothing names one."""
    name = anatomy.activation
    if name is not None:
        try:
            return block.get_submodule(name)
        except AttributeError:
            return ACT2FN[name]
    for attribute in ("hidden_activation", "hidden_act", "activation_function", "activation"):
        value = getattr(config, attribute, None)
        if isinstance(value, str) and value in ACT2FN:
            return ACT2FN[value]
    return None
