"""Softmax attention: its contribution, its per-head outputs and its probabilities."""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.envoy import Envoy

from ..gradients import mark, refuse_gradient
from ..served import check_write, served
from .base import Component


class AttentionEnvoy(Component, Envoy):
    """A block's softmax attention: ``model.layers[i].self_attn``.

    Values, in the order the forward produces them:

    - ``attention_probabilities`` ``[batch, heads, query, key]``: the probabilities that
      multiply the values; needs ``attn_implementation="eager"``.
    - ``attention_head_outputs`` ``[batch, seq, heads, head_dim]``: each head's output before
      the output projection (the projection's input, viewed per head).
    - ``attention_output`` ``[batch, seq, hidden]``: exactly what attention adds to the
      residual stream (after any post-norm or scale the family applies).
    """

    standard_values = ("attention_probabilities", "attention_head_outputs", "attention_output")

    attention_head_outputs = served(
        "attention_head_outputs",
        "per-head outputs before the output projection [b, s, H, head_dim]",
        "Each head's output before the output projection, ``[batch, seq, heads, head_dim]``: the "
        "projection's input viewed per head. Zero ``[..., h, :]`` to ablate head ``h``. Writable.",
    )
    attention_output = served(
        "attention_output",
        "what attention adds to the residual stream [b, s, d]",
        "Exactly what attention adds to the residual stream, ``[batch, seq, hidden]``: "
        "``layer_input + attention_output + mlp_output == layer_output``. Writable.",
    )

    @property
    def attention_probabilities(self) -> torch.Tensor:
        """The attention probabilities, ``[batch, heads, query, key]``, as they multiply the values.

        Needs ``attn_implementation="eager"``. Writable in place (``[:, h] = 0`` removes head ``h``)
        or by assignment.
        """
        self._nncanon_binding("attention_probabilities")
        probabilities = self._probability_operation().input
        reason = self._nncanon_gradient_reason("attention_probabilities")
        if reason is not None:  # (only then: the tensor is the model's own)
            mark(probabilities, f"{self._nncanon.where}.attention_probabilities")
            refuse_gradient(probabilities, reason)
        return probabilities

    @attention_probabilities.setter
    def attention_probabilities(self, value: Any) -> None:
        self._nncanon_binding("attention_probabilities")
        operation = self._probability_operation()
        check_write(value, operation.input, f"{self._nncanon.where}.attention_probabilities")
        operation.input = value.expand_as(operation.input)

    def _probability_operation(self) -> Any:
        """The source operation whose first input is the probabilities."""
        path: tuple[str, ...] | None = self._nncanon.probabilities
        if path is not None:
            source = self.source
            for name in path[:-1]:
                source = getattr(source, name).source
            return getattr(source, path[-1])
        calls = [name for name in self.source.names if name.startswith("attention_interface_")]
        inner = getattr(self.source, calls[-1]).source
        products = [name for name in inner.names if name.startswith("torch_matmul_")]
        return getattr(inner, products[-1])
