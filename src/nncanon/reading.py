"""Reading a block's standard values by name, in the order the forward computes them.

What the tools and the proof share about the surface: which component of a block serves a value (`host`), the
value itself inside a trace (`read`), how many heads a block serves (`head_count`), and the order a block's
forward produces its values in (`in_execution_order`: a trace must read them in that order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .errors import ValueNotAvailable
from .support import COMPONENT_OF
from .threads import ProcessRegistry

#: The standard values of a layer, in the order a forward produces them: the stream entering the block,
#: the token mixer's values (softmax or linear attention), the MLP's (with a mixture of experts' routing),
#: the stream leaving the block.
EXECUTION_ORDER = ("layer_input", *COMPONENT_OF, "layer_output")

#: The component of the block that serves each value (``None``: the block itself).
HOSTS = {"layer_input": None, "layer_output": None, **COMPONENT_OF}

#: The MLP module's output (no standard value: what a block adds may differ from it), ordered among a block's values
#: after its neurons and before its post-norm's scale by `in_execution_order`, read by `read` (`nncanon.graphs`).
MLP_MODULE_OUTPUT = "mlp_module_output"

#: The contributions to the residual stream: ``layer_input`` plus those a block serves is ``layer_output``.
CONTRIBUTIONS = ("attention_output", "linear_attention_output", "mlp_output")


_ORDERS = ProcessRegistry()


def in_execution_order(model: Any, layer: int, names: Sequence[str]) -> list[str]:
    """``names`` of block ``layer`` in the order its forward produces them (a trace must read in that order).

    The stream entering the block comes first and the stream leaving it last. In between the usual
    order is the token mixer's values, then the MLP's, but blocks differ (Falcon-H1 runs its linear
    mixer beside attention; some mixtures of experts run the shared expert before the router). So
    the order is asked of the model: a one-token trace reads the values in the usual order and, at
    a value the forward has already passed, moves it earlier and tries again. The answer is
    remembered per model, block type and set of values.
    """
    ordered = sorted(dict.fromkeys(names), key=_rank)
    inner = [name for name in ordered if name not in ("layer_input", "layer_output")]
    if len(inner) > 1:
        known = _ORDERS.setdefault(model, {})
        key = (type(model.layers[layer]._module).__name__, tuple(inner))
        if key not in known:
            known[key] = _probe_order(model, layer, inner)
        inner = list(known[key])
    head = ["layer_input"] if "layer_input" in ordered else []
    tail = ["layer_output"] if "layer_output" in ordered else []
    return head + inner + tail


def _rank(name: str) -> float:
    """``name``'s place in `EXECUTION_ORDER` (`MLP_MODULE_OUTPUT` just before the MLP's post-norm scale)."""
    if name == MLP_MODULE_OUTPUT:
        return EXECUTION_ORDER.index("mlp_post_norm_scale") - 0.5
    return EXECUTION_ORDER.index(name)


def _probe_order(model: Any, layer: int, order: list[str]) -> list[str]:
    from nnsight.intervention.interleaver import OutOfOrderError

    order = list(order)
    for _ in range(len(order) ** 2 + 1):
        done: list[str] = []  # bound outside the trace, appended inside: what was read before a failure
        try:
            with torch.no_grad(), model.trace("a"):
                for name in order:
                    read(model, layer, name).save()
                    done.append(name)
            return order
        except OutOfOrderError:
            late = len(done)
            if late == 0:
                raise
            order[late - 1], order[late] = order[late], order[late - 1]
    raise RuntimeError(f"could not find the execution order of {order} in layers[{layer}]")  # pragma: no cover


def check_value(name: str, allowed: Sequence[str] = tuple(HOSTS)) -> None:
    """Raise `KeyError` unless ``name`` is one of the standard values in ``allowed``."""
    if name not in allowed:
        raise KeyError(f"{name!r} is not one of the values this tool takes: {', '.join(allowed)}")


def host(model: Any, layer: int, name: str) -> Any:
    """The component of block ``layer`` that serves ``name`` (the block, its ``self_attn`` or its ``mlp``)."""
    check_value(name)
    block = model.layers[layer]
    component = HOSTS[name]
    return block if component is None else getattr(block, component)


def read(model: Any, layer: int, name: str) -> torch.Tensor:
    """The standard value ``name`` of block ``layer``, inside a trace (a served tensor: writes reach the model); or
    `MLP_MODULE_OUTPUT`, the MLP module's output (its first element where it returns a tuple; an inline MLP's down
    projection's, ``(b·s, d)`` where it runs on the tokens flattened: `nncanon.sae.value_at` of its point
    unflattens)."""
    if name == MLP_MODULE_OUTPUT:
        output = _mlp_module(model, layer).output
        return output[0] if isinstance(output, tuple) else output
    return getattr(host(model, layer, name), name)


def _mlp_module(model: Any, layer: int) -> Any:
    """Block ``layer``'s MLP module, or where the block runs its MLP inline (OPT's ``fc1``/``fc2``: `VirtualMLP`) its
    down projection (`nncanon.families.MLPAnatomy.down`), whose output is the MLP's (``(b·s, d)`` where flat)."""
    mlp = model.layers[layer].mlp
    if hasattr(mlp, "_module"):
        return mlp
    envoy = model.layers[layer]
    for part in mlp._nncanon.anatomy.down.split("."):
        envoy = getattr(envoy, part)
    return envoy


def write_mlp_module_output(model: Any, layer: int, value: torch.Tensor) -> None:
    """Write block ``layer``'s MLP module's output with ``value`` (inside a trace); where the module returns a
    tuple (RWKV's feed-forward its state, ZAYA's MLP its router's state for the next block), its first element,
    the rest passed on as the module returned them; where the block runs its MLP inline, its down projection's output
    (``value`` ``[b, s, d]`` reshaped to it: OPT's runs on the tokens flattened)."""
    mlp = _mlp_module(model, layer)
    output = mlp.output
    if isinstance(output, tuple):
        mlp.output = (value, *output[1:])
    else:  # (an inline MLP's down projection may run on the tokens flattened: value in its shape)
        mlp.output = value.reshape(output.shape)


def head_count(model: Any, layer: int, name: str = "attention_head_outputs") -> int:
    """How many heads block ``layer`` serves in ``name`` (``attention_head_outputs`` or a linear mixer's).

    Blocks of one model may differ (a model that alternates head counts); raises `ValueNotAvailable`
    where the block does not serve ``name``.
    """
    require(model, name, [layer])
    return host(model, layer, name).__dict__["_nncanon"].bindings[name].heads


def require(model: Any, name: str, layers: Sequence[int]) -> None:
    """Raise `ValueNotAvailable` (with ``support()``'s reason) if a layer of ``layers`` does not serve ``name``."""
    report = model.support()
    for layer in layers:
        reason = report.reason(name, layer=layer)
        if reason is not None:
            raise ValueNotAvailable(f"layers[{layer}] does not serve {name}: {reason}")


