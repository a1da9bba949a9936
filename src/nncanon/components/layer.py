"""The block: the residual stream before and after it, and its standard components."""

from __future__ import annotations

from typing import Any

from nnsight.intervention.envoy import Envoy

from ..errors import ValueNotAvailable
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
