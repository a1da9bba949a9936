"""Activation patching: a value from a clean run written into a corrupted run, one patch or a sweep."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import product
from typing import Any

import torch

from ..errors import InvalidInput
from ..inputs import prompt_list
from ..reading import check_value, host, require
from ..resuming import resume_at, streams_entering
from ._common import (
    Positions,
    _as_index,
    check_indices,
    check_pair,
    checked_positions,
    layer_list,
    none_serves,
    one_prompts,
    serving,
    token_count,
)

#: The values activation patching writes.
PATCHABLE = (
    "layer_input",
    "layer_output",
    "attention_head_outputs",
    "attention_output",
    "linear_attention_head_outputs",
    "linear_attention_output",
    "mlp_output",
)

#: A metric: the corrupted run's ``logits`` ``[batch, seq, vocab]`` to what the sweep records per item.
Metric = Callable[[torch.Tensor], torch.Tensor]


def last_token_logits(logits: torch.Tensor) -> torch.Tensor:
    """The default metric: the logits at the last position, ``[batch, vocab]``."""
    return logits[:, -1]


def logit_difference(correct: int, incorrect: int) -> Metric:
    """A metric: ``logits[:, -1, correct] - logits[:, -1, incorrect]``, ``[batch]``.

    A token outside the logits' vocabulary is refused when the metric runs (`InvalidInput`, naming the call).
    """
    call = f"logit_difference({correct!r}, {incorrect!r})"
    for token in (correct, incorrect):
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidInput(f"{call}: a token is an int id (model.tokenizer(word).input_ids), not "
                               f"{type(token).__name__}")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        size = logits.shape[-1]
        outside = [token for token in (correct, incorrect) if not -size <= token < size]
        if outside:
            raise InvalidInput(f"{call}: token(s) {outside} are outside the logits' vocabulary of {size} tokens (an id "
                               f"is in 0..{size - 1}): take the ids from model.tokenizer(word).input_ids")
        return logits[:, -1, correct] - logits[:, -1, incorrect]

    return metric


def run_metric(model: Any, prompts: str | Sequence[str], metric: Metric = last_token_logits) -> torch.Tensor:
    """``metric`` of an unpatched run: the baselines a patching result is read against (clean, corrupted)."""
    with torch.no_grad(), model.trace(prompt_list(prompts)):
        value = metric(model.logits).save()
    return one_prompts(value, prompts)


def _write(model: Any, layer: int, name: str, source: torch.Tensor, position: Any, head: Any) -> None:
    """Write ``source`` (the clean value) into this invoke's value at ``position`` / ``head``; inside a trace."""
    target = getattr(host(model, layer, name), name)
    source = source.to(device=target.device, dtype=target.dtype)
    where = selection(position, head)
    target[where] = source[where]


def selection(position: Any, head: Any) -> tuple:
    """The index of ``[:, position, head]`` (``None``: all), as an outer product where both are lists."""
    if isinstance(position, list) and isinstance(head, list):
        return (slice(None), torch.tensor(position)[:, None], torch.tensor(head)[None, :])
    where: tuple = (slice(None), slice(None) if position is None else position)
    if head is not None:
        where = (*where, head)
    return where


def clean_values(
    model: Any, prompts: str | Sequence[str], value: str, layers: Sequence[int]
) -> dict[int, torch.Tensor]:
    """``value`` at each of ``layers`` from one clean forward: ``{layer: [batch, seq, ...]}``."""
    saved: dict[int, torch.Tensor] = {}
    with torch.no_grad(), model.trace(prompt_list(prompts)):
        for index in sorted(set(layers)):
            saved[index] = getattr(host(model, index, value), value).save()
    return saved


def patch(
    model: Any,
    clean: str | Sequence[str],
    corrupted: str | Sequence[str],
    value: str,
    layer: int,
    positions: Positions = None,
    heads: int | Sequence[int] | None = None,
    metric: Metric = last_token_logits,
) -> torch.Tensor:
    """One patch: ``value`` of block ``layer`` from the clean run written into the corrupted run.

    Args:
        model: A `StandardizedTransformer`.
        clean: The prompt (or prompts) whose values are patched in.
        corrupted: The prompt (or prompts) patched, each of the same token length as its clean prompt.
        value: One of `PATCHABLE`: ``"layer_output"``, ``"layer_input"``, ``"attention_output"``,
            ``"mlp_output"``, ``"attention_head_outputs"`` (and a hybrid's ``linear_attention_*``).
        layer: The block.
        positions: Positions to patch (default: all).
        heads: For ``*_head_outputs``, the head(s) to patch (default: all).
        metric: Maps the corrupted run's logits ``[batch, seq, vocab]`` to the result
            (default: the last position's logits).

    Returns:
        ``metric`` of the patched run (the batch axis dropped for single prompts).
    """
    check_value(value, PATCHABLE)
    if heads is not None and not value.endswith("head_outputs"):
        raise ValueError("heads= patches attention_head_outputs (or linear_attention_head_outputs) only")
    check_pair(model, clean, corrupted, "patching")
    index = layer_list(model, layer)[0]
    require(model, value, [index])
    source = clean_values(model, clean, value, [index])[index]
    head = None if heads is None else (heads if isinstance(heads, int) else list(heads))
    position = None if positions is None else _as_index(positions)
    if position is not None:
        checked_positions(position, source.shape[1])
    if head is not None:
        count = source.shape[2]
        check_indices([head] if isinstance(head, int) else head, count, "heads", f"layers[{index}] has {count} heads")
    with torch.no_grad(), model.trace(prompt_list(corrupted)):
        _write(model, index, value, source, position, head)
        result = metric(model.logits).save()
    return one_prompts(result, clean)


def activation_patching(
    model: Any,
    clean: str | Sequence[str],
    corrupted: str | Sequence[str],
    value: str = "layer_output",
    layers: int | Sequence[int] | None = None,
    positions: str | Sequence[int] | None = "each",
    heads: str | Sequence[int] | None = None,
    metric: Metric = last_token_logits,
    batch_size: int = 32,
) -> torch.Tensor:
    """A patching sweep: one patch per (layer, position, head), as batched invokes, ``batch_size`` per trace.

    Each item writes the clean run's ``value`` of one layer (at one position, of one head) into the
    corrupted run and records ``metric`` of the result. The clean values come from one forward;
    then every ``batch_size`` items run as the invokes of one trace (a patch in one invoke touches
    its own rows only), so a sweep of ``n`` items costs ``1 + ceil(n / batch_size)`` forwards, less
    the blocks before each trace's first layer: the corrupted run's are the same for all its items,
    so they run once (`nncanon.resuming`) and each trace resumes at its first layer.

    Args:
        model: A `StandardizedTransformer`.
        clean: The prompt (or prompts) whose values are patched in.
        corrupted: The prompt (or prompts) patched, each of the same token length as its clean prompt.
        value: One of `PATCHABLE`: ``"layer_output"`` (default), ``"layer_input"``, ``"attention_output"``,
            ``"mlp_output"``, ``"attention_head_outputs"`` (and a hybrid's ``linear_attention_*``).
        layers: The layers to sweep (default: every layer that serves ``value``, per ``model.support()``).
        positions: ``"each"`` (default: sweep every position), a list of positions to sweep, or
            ``None`` (no position axis: patch all positions at once).
        heads: For ``*_head_outputs``: ``"each"`` (sweep every head of the widest layer), a list of heads
            to sweep, or ``None`` (no head axis: patch all heads at once). Where a layer has fewer heads than
            the widest (blocks that differ), its items past its count are NaN.
        metric: Maps the corrupted run's logits ``[batch, seq, vocab]`` to what is recorded
            (default: the last position's logits; `logit_difference` gives one number per prompt).
        batch_size: Items per trace (memory: each item is one copy of the batch).

    Returns:
        ``[len(layers), len(positions)?, len(heads)?, *metric]``: the position and head axes are
        there when swept; the batch axis of ``metric`` is dropped for single prompts. Ready for
        ``imshow``.
    """
    check_value(value, PATCHABLE)
    for name, given in (("positions", positions), ("heads", heads)):
        if (isinstance(given, str) and given != "each") or isinstance(given, int):
            hint = f" ([{given}] sweeps that one)" if isinstance(given, int) else ""
            raise InvalidInput(f'{name}={given!r}: give "each", a list of indices{hint} or None')
    if heads is not None and not value.endswith("head_outputs"):
        raise ValueError("heads= sweeps attention_head_outputs (or linear_attention_head_outputs) only")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    check_pair(model, clean, corrupted, "patching")
    indices = serving(model, value, layers)
    if not indices:
        raise none_serves(model, value)
    length = token_count(model, clean)
    position_axis = list(range(length)) if positions == "each" else (None if positions is None else list(positions))
    if position_axis is not None:
        checked_positions(position_axis, length)

    sources = clean_values(model, clean, value, indices)
    counts = {index: sources[index].shape[2] for index in indices} if heads is not None else {}
    width = max(counts.values(), default=0)
    head_axis = list(range(width)) if heads == "each" else (None if heads is None else list(heads))
    if head_axis is not None:
        check_indices(head_axis, width, "heads", f"the widest of these layers has {width} heads")
    grid = list(product(indices, position_axis or [None], head_axis or [None]))
    # A layer with fewer heads than the widest (a model whose blocks differ) has no item past its count: NaN there.
    items = [item for item in grid if item[2] is None or -counts[item[0]] <= item[2] < counts[item[0]]]
    # The corrupted run's blocks before a chunk's first layer are the same for all its items: run them once.
    chunks = [items[start : start + batch_size] for start in range(0, len(items), batch_size)]
    # (The earliest layer of a chunk: ``layers`` may be given in any order.)
    streams = streams_entering(model, corrupted, sorted({min(item[0] for item in chunk) for chunk in chunks}))
    results: list[torch.Tensor] = []
    for chunk in chunks:
        first = min(item[0] for item in chunk)
        with torch.no_grad(), model.trace() as tracer:
            for index, position, head in chunk:
                with tracer.invoke(prompt_list(corrupted)):
                    resume_at(model, first, streams[first])
                    _write(model, index, value, sources[index], position, head)
                    results.append(metric(model.logits).save())
    done = [one_prompts(r, clean) for r in results]
    if len(items) < len(grid):
        ran = dict(zip(items, done, strict=True))
        blank = torch.full_like(done[0], float("nan"), dtype=torch.result_type(done[0], 0.5))
        done = [ran.get(item, blank) for item in grid]
    stacked = torch.stack(done)
    shape = [len(indices)]
    if position_axis is not None:
        shape.append(len(position_axis))
    if head_axis is not None:
        shape.append(len(head_axis))
    return stacked.reshape(*shape, *stacked.shape[1:])


__all__ = [
    "PATCHABLE",
    "activation_patching",
    "clean_values",
    "last_token_logits",
    "logit_difference",
    "patch",
    "run_metric",
]
