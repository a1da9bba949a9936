"""What ``skip_layers`` checks before it skips: the blocks asked for, that no earlier skip overlaps or follows them,
that the model has not run past them, that no cache needs them, and that a replacement looks like the stream."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from .components.layer import layer_index
from .errors import InvalidLayer, InvalidSkip, OutOfOrderRead
from .order import SkipRecord, note_read, skips
from .served import _rows
from .threads import generation_cache


def skip_input(model: Any, start: int, end: int) -> torch.Tensor:
    """``layers[start].layer_input``, the stream the skip passes on; a skip made after a read of a value the
    model computes later (the model has run past ``layers[start]``) is an `InvalidSkip` naming that read."""
    try:
        stream = model.layers[start].layer_input
        # The skip's own read: a later read of an earlier value is out of order because of the skip; say so.
        note_read(Mediator.current("skip_layers"), f"skip_layers({start}, {end})")
        return stream
    except OutOfOrderRead:
        last = Mediator.current("skip_layers").__dict__.get("_nncanon_last_read")
        read = f"{last} was read" if last is not None else "a value of a later block was read"
        raise InvalidSkip(
            f"skip_layers({start}, {end}) comes after {read} in this trace: the model had run past the start "
            f"of layers[{start}] by then, so it can no longer skip it. Make the skip before reading values of "
            f"layers[{start}] or later (reads of earlier blocks may come first)."
        ) from None


def one_invoke(start: int, end: int) -> None:
    """Refuse a skip in a trace with several invokes on a model whose blocks take stacked streams:
    nnsight joins the invokes' skips on the first axis, which is the streams' there."""
    if _rows(Mediator.current("skip_layers"))[1] is not None:
        raise InvalidSkip(
            f"skip_layers({start}, {end}) in a trace with several invokes: this model's blocks take their "
            "streams stacked first ([k, b, s, d]) and nnsight joins the invokes' skips on the first axis. "
            "Skip in a trace with one invoke (batch the prompts in that invoke)."
        )


def check_not_generating_with_cache(model: Any, start: int, end: int) -> None:
    """Refuse a skip inside ``generate`` with a cache, before the forward runs (see `skip_layers`)."""
    if generation_cache(model):
        raise InvalidSkip(
            f"skip_layers({start}, {end}) inside model.generate with a cache: a skipped block writes no "
            "key/value cache (nor a hybrid's recurrent state) for the tokens of that step, so a later "
            "step would run the block on a cache missing them (transformers crashes on a shape, or a "
            "hybrid runs on silently without that state). Generate with use_cache=False (each step "
            "runs the whole sequence, and the skip applies to that step's forward), or skip in "
            "model.trace."
        )


def skip_range(model: Any, start: Any, end: Any) -> tuple[int, int]:
    """``(start, end)`` as block indices by `layer_index`'s rule (negative counts from the end), or raise."""
    end = start if end is None else end
    count = model.num_layers
    try:
        first, last = layer_index(start, count, "skip_layers"), layer_index(end, count, "skip_layers")
    except InvalidLayer as error:
        where = "" if isinstance(error.__cause__, TypeError) else f" asks for blocks outside 0..{count - 1}"
        raise InvalidSkip(
            f"skip_layers({start!r}, {end!r}){where}: {error} Give 0 <= start <= end < {count} "
            "(end is inclusive; negative counts from the end)."
        ) from None
    if first > last:
        raise InvalidSkip(
            f"skip_layers({start}, {end}) asks for blocks {first}..{last}, which is empty; "
            f"give start <= end (end is inclusive; both in 0..{count - 1}, or negative from the end)."
        )
    return first, last


def new_skip(model: Any, start: int, end: int) -> Callable[[], None]:
    """Refuse a skip that overlaps or precedes one this invoke already made; return what notes it."""
    first = model.layers[0].__dict__["_nncanon"].bindings["layer_input"].location
    mediator = Mediator.current("skip_layers")
    record = SkipRecord(start, end, mediator.wanted(first))
    for made in skips(mediator):
        if made.step != record.step:
            continue
        if made.start <= end and start <= made.end:
            raise InvalidSkip(
                f"{record.call} overlaps {made.call}, made earlier in this trace: blocks "
                f"{max(start, made.start)}..{min(end, made.end)} would be skipped twice. Make one call, "
                f"skip_layers({min(start, made.start)}, {max(end, made.end)})."
            )
        if start < made.start:
            raise InvalidSkip(
                f"{record.call} comes after {made.call} in this trace, but its blocks run first: "
                "the model runs blocks in index order, so make skips (and reads) in that order."
            )
    return partial(skips(mediator).append, record)


def check_replacement(value: Any, expected: torch.Tensor, start: int, end: int) -> None:
    what = f"skip_layers({start}, {end}, skip_with=...)"
    if not isinstance(value, torch.Tensor):
        raise InvalidSkip(
            f"{what} got a {type(value).__name__}; blocks {start}..{end} need a tensor like "
            f"layers[{start}].layer_input: shape {tuple(expected.shape)}, dtype {expected.dtype}, "
            f"on {expected.device}. Pass the hidden state itself; the block's tuple structure is added for you."
        )
    problems = []
    if value.shape != expected.shape:
        problems.append(f"shape {tuple(value.shape)} (expected {tuple(expected.shape)})")
    if value.dtype != expected.dtype:
        problems.append(f"dtype {value.dtype} (expected {expected.dtype})")
    if value.device != expected.device:
        problems.append(f"device {value.device} (expected {expected.device})")
    if problems:
        raise InvalidSkip(
            f"{what}: the replacement for layers {start}..{end} has " + ", ".join(problems)
            + f"; it must look like layers[{start}].layer_input."
        )
