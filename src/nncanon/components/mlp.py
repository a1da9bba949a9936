"""The MLP: its contribution to the residual stream."""

from __future__ import annotations

from typing import Any

from nnsight.intervention.envoy import Envoy

from ..served import served
from .base import Component, ComponentState

_MLP_OUTPUT_DOC = (
    "Exactly what the MLP adds to the residual stream, ``[batch, seq, hidden]``: "
    "``layer_input + attention_output + mlp_output == layer_output``. Writable."
)


class MLPEnvoy(Component, Envoy):
    """A block's MLP: ``model.layers[i].mlp``."""

    standard_values = ("mlp_output",)

    mlp_output = served("mlp_output", "what the MLP adds to the residual stream [b, s, d]", _MLP_OUTPUT_DOC)


class VirtualMLP(Component):
    """``model.layers[i].mlp`` for a family whose MLP is not a module of its own (OPT).

    It serves ``mlp_output`` from the modules the block runs inline; everything else about
    those modules is on the block (``model.layers[i].fc1``, ``.fc2``).
    """

    standard_values = ("mlp_output",)

    mlp_output = served("mlp_output", "what the MLP adds to the residual stream [b, s, d]", _MLP_OUTPUT_DOC)

    def __init__(self, state: ComponentState) -> None:
        self._nncanon = state

    def __getattr__(self, name: str) -> Any:
        if name in type(self).standard_values:
            self._nncanon_binding(name)
        raise AttributeError(
            f"{self._nncanon.where} is the MLP of a block that runs it inline, not a module: "
            f"it serves mlp_output only; the block's own modules hold the rest."
        )

    def __repr__(self) -> str:
        return f"VirtualMLP({self._nncanon.where}: mlp_output)"
