"""Steering: add a vector to the residual stream at chosen layers and positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidInput
from ..traced import refuse_outside_trace
from ._common import Positions, checked_positions, finite, layer_list


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
        vector: ``[hidden]``; ``[batch, hidden]``: each prompt by its own vector (at every position of
            ``positions``); or ``[batch, positions, hidden]``, any shape that broadcasts to
            ``layer_output[:, positions]`` (``[1, seq, hidden]``: one vector per position). Finite: NaN or an
            infinity is refused (`InvalidInput`), as is a vector that is not a tensor.
        factor: The scale of the vector (a finite number).
        positions: Positions of the (left-padded) sequence to steer: ``None`` (all), an index,
            a list, a slice or an index tensor.

    Example:
        >>> with model.trace(prompt):
        ...     steer(model, [3, 4], direction, factor=4.0, positions=-1)
        ...     probs = model.next_token_probs.save()
    """
    refuse_outside_trace(model, "steer(model, ...) was called")
    if not isinstance(vector, torch.Tensor):
        raise InvalidInput(f"steer's vector is a {type(vector).__name__}; it takes a tensor [hidden] (or [batch, "
                           f"hidden], one per prompt): torch.tensor(vector) makes one.")
    if isinstance(factor, bool) or not isinstance(factor, (int, float, torch.Tensor)):
        raise InvalidInput(f"steer's factor is a {type(factor).__name__}; it takes a number (the vector's scale).")
    finite("steer", "vector", vector)
    finite("steer", "factor", factor)
    delta = factor * vector
    for index in sorted(set(layer_list(model, layers))):
        output = model.layers[index].layer_output
        added = _fitted(delta.to(device=output.device, dtype=output.dtype), output, positions)
        if positions is None:
            output += added
        else:
            output[:, checked_positions(positions, output.shape[1])] += added


def _fitted(added: torch.Tensor, output: torch.Tensor, positions: Positions) -> torch.Tensor:
    """``added`` shaped to broadcast to ``output[:, positions]``: a ``[batch, hidden]`` vector gets the position
    axis where ``positions`` keeps one (else its rows would line up with the positions, not the prompts)."""
    if added.dim() == 0:  # one number added to every feature
        return added
    if added.shape[-1] not in (1, output.shape[-1]):
        raise InvalidInput(f"the steering vector is {tuple(added.shape)}; the stream is {output.shape[-1]} wide: "
                           f"give [{output.shape[-1]}] (or [batch, {output.shape[-1]}], one per prompt)")
    one_position = isinstance(positions, int) or (isinstance(positions, torch.Tensor) and positions.dim() == 0)
    if added.dim() != 2 or one_position:
        return added
    if added.shape[0] not in (1, output.shape[0]):
        raise InvalidInput(f"the steering vector is {tuple(added.shape)}: a 2-D vector is one per prompt, "
                           f"[batch, hidden] = [{output.shape[0]}, {output.shape[-1]}] here")
    return added[:, None]
