"""The block: the residual stream before and after it, and its standard components."""

from __future__ import annotations

import numbers
from typing import Any

from nnsight.intervention.envoy import Envoy

from ..errors import InvalidLayer, ValueNotAvailable
from ..served import served
from .base import Component

#: The components a block may serve, by standard name.
COMPONENT_NAMES = ("self_attn", "linear_attn", "mlp")


class LayerEnvoy(Component, Envoy):
    """Block ``i`` of the model: ``model.layers[i]``.

    ``layer_input`` and ``layer_output`` are the residual stream, ``[batch, seq, hidden]``,
    always a tensor (also where the block returns a tuple). ``self_attn``, ``linear_attn`` and
    ``mlp`` are the block's softmax attention, other token mixer and MLP, whatever the family calls
    them; a block without one raises `ValueNotAvailable` naming what it has.
    """

    standard_values = ("layer_input", "layer_output")

    layer_input = served(
        "layer_input",
        "residual stream before the block [b, s, d]",
        "The residual stream entering the block, ``[batch, seq, hidden]``. Writable.",
    )
    layer_output = served(
        "layer_output",
        "residual stream after the block [b, s, d]",
        "The residual stream leaving the block, ``[batch, seq, hidden]``, a tensor even where "
        "the block returns a tuple. Writable.",
    )

    def __getattr__(self, name: str) -> Any:
        if name in COMPONENT_NAMES:
            state = self._nncanon_state(name)
            reason = state.reason(name) or "this block has no such component"
            raise ValueNotAvailable(f"{state.where}.{name} is not available: {reason}")
        return super().__getattr__(name)


def layer_index(value: Any, count: int, what: str = "model.layers") -> int:
    """``value`` as a block index in ``0..count-1``: the one rule for layer indices.

    An int (not a bool, a float or a tensor); a negative one counts from the end, as in Python
    (``-1`` is the last block). Used by ``model.layers[i]``, ``skip_layers`` and every tool.

    Raises:
        InvalidLayer: (an ``IndexError`` and a ``TypeError``) naming ``what`` and the valid range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidLayer(
            f"{what} was given {value!r} ({type(value).__name__}); a layer index is an int in "
            f"{-count}..{count - 1} (negative counts from the end)."
        ) from TypeError(type(value).__name__)
    index = int(value)
    if not -count <= index < count:
        raise InvalidLayer(
            f"layer {index} is out of range for {what}: this model has {count} layers, so an index is in "
            f"0..{count - 1} (or {-count}..-1 from the end)."
        )
    return index % count


class LayersEnvoy(Envoy):
    """``model.layers``: the blocks, indexed by `layer_index`'s rule, sliced, or by nnsight's block name (``"0"``)."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str) and key not in self._module._modules:
            count = len(self)
            raise InvalidLayer(
                f"model.layers was given {key!r}: no block is named that; this model has {count} blocks, named "
                f"'0'..'{count - 1}'. Index with an int in {-count}..{count - 1} (negative counts from the end)."
            )
        if isinstance(key, (slice, str)):
            return super().__getitem__(key)
        return super().__getitem__(layer_index(key, len(self)))
