"""Ablation: zero or mean ablation of heads, attention, MLPs and whole blocks (the ablation page's recipes).

The ``*_ablate*`` functions are called inside a trace (inside one invoke: they touch that invoke's
rows only); `mean_values` runs its own forward over a reference set. What each value means:

- ``"attention_head_outputs"`` with ``heads``: head ``h``'s output before the output projection
  (zero it and the head adds nothing);
- ``"attention_output"`` / ``"mlp_output"``: exactly what the sublayer adds to the stream (a hybrid's
  ``"linear_attention_output"`` / ``"linear_attention_head_outputs"`` likewise);
- ``"block"``: the whole block's contribution, ``layer_output - layer_input``. Zero-ablating it
  passes the stream through unchanged, like ``model.skip_layers`` but inside one invoke (the block
  still runs; `skip_blocks` saves the compute, in a trace of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._common import Positions, _as_index, check_value, host, prompt_list, serving

#: The values these helpers ablate.
ABLATABLE = (
    "attention_head_outputs",
    "attention_output",
    "linear_attention_head_outputs",
    "linear_attention_output",
    "mlp_output",
    "block",
)


def _support_name(value: str) -> str:
    return "layer_output" if value == "block" else value


def _index(positions: Positions, heads: int | Sequence[int] | None, value: str) -> tuple:
    if heads is not None and not value.endswith("head_outputs"):
        raise ValueError("heads= applies to attention_head_outputs (or linear_attention_head_outputs) only")
    position = slice(None) if positions is None else _as_index(positions)
    if heads is None:
        return (slice(None), position)
    head = heads if isinstance(heads, int) else list(heads)
    if isinstance(head, list) and not isinstance(position, slice) and not isinstance(position, int):
        return (slice(None), torch.as_tensor(position)[:, None], torch.tensor(head)[None, :])
    return (slice(None), position, head)


def _ablate(model: Any, layer: int, value: str, replacement: Any, heads: Any, positions: Positions) -> None:
    check_value(value, ABLATABLE)
    where = _index(positions, heads, value)
    if value == "block":
        block = model.layers[layer]
        entering = block.layer_input.clone()
        leaving = block.layer_output
        if isinstance(replacement, torch.Tensor):
            replacement = replacement.to(device=leaving.device, dtype=leaving.dtype)
        leaving[where] = entering[where] + replacement
        return
    target = getattr(host(model, layer, value), value)
    if isinstance(replacement, torch.Tensor):
        replacement = replacement.to(device=target.device, dtype=target.dtype)
        if heads is not None and replacement.dim() >= 2:  # a [heads, head_dim] mean: the rows of these heads
            replacement = replacement[heads if isinstance(heads, int) else list(heads)]
    target[where] = replacement


def zero_ablate(
    model: Any,
    layer: int,
    value: str,
    heads: int | Sequence[int] | None = None,
    positions: Positions = None,
) -> None:
    """Zero ``value`` of block ``layer`` (at ``positions``; for heads, of ``heads``) in this invoke; inside a trace.

    ``value`` is one of ``"attention_head_outputs"`` (with ``heads``), ``"attention_output"``,
    ``"mlp_output"`` or ``"block"`` (the block adds nothing: its output is its input).
    """
    _ablate(model, layer, value, 0.0, heads, positions)


def mean_ablate(
    model: Any,
    layer: int,
    value: str,
    mean: torch.Tensor,
    heads: int | Sequence[int] | None = None,
    positions: Positions = None,
) -> None:
    """Replace ``value`` of block ``layer`` by ``mean`` (from `mean_values`) in this invoke; inside a trace.

    ``mean`` is ``[hidden]`` (``[heads, head_dim]`` for ``attention_head_outputs``: the rows of
    ``heads`` are used). For ``"block"`` the block's output becomes its input plus the mean
    contribution.
    """
    _ablate(model, layer, value, mean, heads, positions)


def mean_values(
    model: Any,
    prompts: str | Sequence[str],
    value: str,
    layers: int | Sequence[int] | None = None,
    positions: Positions = -1,
) -> dict[int, torch.Tensor]:
    """The mean of ``value`` over a reference set, per layer, from one forward.

    Args:
        model: A `StandardizedTransformer`.
        prompts: The reference prompts (left-padded in one batch).
        value: ``"attention_head_outputs"``, ``"attention_output"``, ``"mlp_output"`` or ``"block"``.
        layers: The layers (default: every layer that serves ``value``, per ``model.support()``).
        positions: ``-1`` (default: every prompt's last token), other positions of the padded batch,
            or ``None``: every real (non-padding) token of every prompt.

    Returns:
        ``{layer: mean}``, each ``[hidden]`` (``[heads, head_dim]`` for head outputs).
    """
    check_value(value, ABLATABLE)
    indices = serving(model, _support_name(value), layers)
    prompts = prompt_list(prompts)
    raw: dict[int, torch.Tensor] = {}
    with torch.no_grad(), model.trace(prompts):
        for index in sorted(set(indices)):
            if value == "block":
                block = model.layers[index]
                entering = block.layer_input.clone()
                raw[index] = (block.layer_output - entering).save()
            else:
                raw[index] = getattr(host(model, index, value), value).save()
    means = {}
    if positions is None:
        mask = model.tokenizer(prompts, padding=True, return_tensors="pt")["attention_mask"]
        for index in indices:
            tensor = raw[index]
            weights = mask.to(tensor.device, tensor.dtype).reshape(*mask.shape, *([1] * (tensor.dim() - 2)))
            means[index] = (tensor * weights).sum((0, 1)) / weights.sum()
        return means
    for index in indices:
        picked = raw[index][:, _as_index(positions)]
        if picked.dim() == raw[index].dim():  # several positions: average them too
            picked = picked.flatten(0, 1)
        means[index] = picked.mean(0)
    return means


def zero_ablate_heads(model: Any, layer: int, heads: int | Sequence[int], positions: Positions = None) -> None:
    """Zero heads ``heads`` of block ``layer`` (their outputs before the projection); inside a trace."""
    zero_ablate(model, layer, "attention_head_outputs", heads=heads, positions=positions)


def zero_ablate_attention(model: Any, layer: int, positions: Positions = None) -> None:
    """Zero what block ``layer``'s attention adds to the stream; inside a trace."""
    zero_ablate(model, layer, "attention_output", positions=positions)


def zero_ablate_mlp(model: Any, layer: int, positions: Positions = None) -> None:
    """Zero what block ``layer``'s MLP adds to the stream; inside a trace."""
    zero_ablate(model, layer, "mlp_output", positions=positions)


def zero_ablate_block(model: Any, layer: int, positions: Positions = None) -> None:
    """Block ``layer`` adds nothing (its output is its input) in this invoke; inside a trace."""
    zero_ablate(model, layer, "block", positions=positions)


def skip_blocks(model: Any, start: int, end: int | None = None) -> None:
    """Blocks ``start..end`` (inclusive) do not run: ``model.skip_layers``; inside a trace that covers every row."""
    model.skip_layers(start, end)


__all__ = [
    "ABLATABLE",
    "mean_ablate",
    "mean_values",
    "skip_blocks",
    "zero_ablate",
    "zero_ablate_attention",
    "zero_ablate_block",
    "zero_ablate_heads",
    "zero_ablate_mlp",
]
