"""Steering: add a vector to the residual stream at chosen layers and positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._common import Positions, checked_positions, layer_list


def steer(
    model: Any,
    layers: int | Sequence[int],
    vector: torch.Tensor,
    factor: float = 1.0,
    positions: Positions = None,
) -> None:
    """Add ``factor · vector`` to ``layers[l].layer_output`` for each ``l`` in ``layers``; call inside a trace.

    The addition is in place on the served stream, so it reaches every later layer and the
    logits, and in a batched trace it touches the calling invoke's rows only. The value added
    is exactly ``(factor * vector)`` cast to the stream's dtype and device: the steered output
    is ``clean + delta`` element for element, nothing else moves.

    Args:
        model: A `StandardizedTransformer`, inside ``model.trace()`` / ``model.generate()``.
        layers: A layer or several (applied in execution order, so every layer can be steered
            in one call).
        vector: ``[hidden]``, or any shape that broadcasts to ``layer_output[:, positions]``
            (``[batch, hidden]`` steers each row by its own vector).
        factor: The scale of the vector.
        positions: Positions of the (left-padded) sequence to steer: ``None`` (all), an index,
            a list, a slice or an index tensor.

    Example:
        >>> with model.trace(prompt):
        ...     steer(model, [3, 4], direction, factor=4.0, positions=-1)
        ...     probs = model.next_token_probs.save()
    """
    delta = factor * vector
    for index in sorted(set(layer_list(model, layers))):
        output = model.layers[index].layer_output
        added = delta.to(device=output.device, dtype=output.dtype)
        if positions is None:
            output += added
        else:
            output[:, checked_positions(positions, output.shape[1])] += added
