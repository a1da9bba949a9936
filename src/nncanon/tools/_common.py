"""What the tools share: the layers a tool runs on, prompts paired by length, positions and indices checked."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Union

import torch

from ..components.layer import layer_index
from ..errors import InvalidInput, ValueNotAvailable
from ..inputs import prompt_list
from ..reading import require

#: Positions along the sequence axis: ``None`` (all), an index, a list of indices, a slice or an index tensor.
Positions = Union[int, Sequence[int], slice, torch.Tensor, None]  # noqa: UP007 - a runtime alias, kept 3.10-safe


def serving(model: Any, name: str, layers: int | Sequence[int] | None) -> list[int]:
    """``layers`` checked against ``support()`` (an empty list is `InvalidInput`); ``None``: every layer that serves
    ``name``."""
    if layers is None:
        return model.support().layers_with(name)
    indices = layer_list(model, layers)
    if not indices:
        raise InvalidInput(f"layers={layers!r} names no layer: give a layer, a list of layers, or None for every "
                           f"layer that serves {name}")
    require(model, name, indices)
    return indices


def none_serves(model: Any, what: str) -> ValueNotAvailable:
    """The error of a tool whose value no layer of ``model`` serves, with the one cause where a single one
    declined every value (no twin of the config runs)."""
    cause = model.support().cause
    return ValueNotAvailable(f"no layer of this model serves {what}: "
                             f"{cause if cause else 'see model.support() for why each layer does not'}")


def layer_list(model: Any, layers: int | Sequence[int] | None) -> list[int]:
    """``layers`` as a list of non-negative indices (``None``: every layer), by `layer_index`'s rule."""
    count = model.num_layers
    if layers is None:
        return list(range(count))
    if not isinstance(layers, (Sequence, set, frozenset)) or isinstance(layers, str):
        layers = [layers]
    return [layer_index(layer, count, "layers") for layer in layers]


def one_prompts(value: torch.Tensor, prompts: Any) -> torch.Tensor:
    """A metric's ``value`` for ``prompts``: its batch axis dropped where ``prompts`` is one string.

    A scalar stays as it is; a value whose first axis is not the batch of one (a metric that dropped the batch
    axis itself, ``logits[0, -1]``) is refused (`InvalidInput`) rather than cut to its first element.
    """
    if not isinstance(prompts, str) or value.dim() == 0:
        return value
    if value.shape[0] != 1:
        raise InvalidInput(f"the metric returned {tuple(value.shape)} for one prompt: keep the batch axis first "
                           "([1, ...], e.g. logits[:, -1]) or return a scalar")
    return value[0]


def token_count(model: Any, prompts: str | Sequence[str]) -> int:
    """The (left-padded) length of ``prompts`` as one batch, as a trace tokenizes them (prompts or token ids)."""
    return max((prompt_length(model, prompt) for prompt in prompt_list(prompts)), default=0)


def prompt_length(model: Any, prompt: Any) -> int:
    """How many tokens a trace runs ``prompt`` as: a string tokenized, or token ids (a 1-D tensor or list) as given."""
    if isinstance(prompt, str):
        return len(model.tokenizer(prompt)["input_ids"])
    return len(prompt)


def check_pair(model: Any, clean: str | Sequence[str], corrupted: str | Sequence[str], tool: str) -> None:
    """Raise `InvalidInput` unless ``clean`` and ``corrupted`` pair up prompt by prompt, of the same token length.

    Each clean prompt must tokenize to as many tokens as its corrupted partner, not just the batches to
    the same padded length: with left padding, a shorter partner's padding would stand where the other
    prompt has tokens, and a patch at a position would move a real token's value into padding (or back).
    """
    if isinstance(clean, str) != isinstance(corrupted, str) or len(prompt_list(clean)) != len(prompt_list(corrupted)):
        raise InvalidInput("clean and corrupted must be two prompts or two lists of the same length")
    if not prompt_list(clean):
        raise InvalidInput("clean and corrupted are empty lists: give a prompt, or a list of prompts, for each")
    pairs = zip(prompt_list(clean), prompt_list(corrupted), strict=True)
    for index, (a, b) in enumerate(pairs):
        lengths = [prompt_length(model, prompt) for prompt in (a, b)]
        if lengths[0] != lengths[1]:
            which = "" if isinstance(clean, str) else f" (pair {index})"
            raise InvalidInput(
                f"clean and corrupted prompts{which} tokenize to {lengths[0]} and {lengths[1]} tokens: positions "
                f"must line up, so {tool} needs each clean prompt and its corrupted partner of the same length"
            )


def check_indices(indices: Sequence[int], size: int, name: str, why: str) -> None:
    """Raise `InvalidInput` unless every index of ``indices`` is in ``-size..size-1`` (``why``: what ``size`` is)."""
    outside = [int(index) for index in indices if not -size <= index < size]
    if outside:
        raise InvalidInput(f"{name}={outside} is out of range: {why}, so an index is in 0..{size - 1} "
                           f"(or {-size}..-1 from the end)")


def checked_positions(positions: Positions, length: int) -> Any:
    """``positions`` as an index of the sequence axis, refused (`InvalidInput`) where one is not in a sequence of
    ``length`` tokens (a slice or a mask is taken as it is)."""
    index = _as_index(positions)
    if isinstance(index, torch.Tensor):
        if index.dtype == torch.bool:
            return index
        listed = index.flatten().tolist()
    else:
        listed = [] if isinstance(index, slice) else [index] if isinstance(index, int) else index
    check_indices(listed, length, "positions", f"the sequence is {length} tokens long (padded)")
    return index


def index_positions(value: torch.Tensor, positions: Positions) -> torch.Tensor:
    """``value[:, positions]`` (all of ``value`` when ``positions`` is ``None``)."""
    if positions is None:
        return value
    return value[:, checked_positions(positions, value.shape[1])]


def finite(tool: str, argument: str, value: Any) -> None:
    """Raise `InvalidInput` naming ``tool`` and ``argument`` where ``value`` (a number or a tensor) holds NaN or an
    infinity: added to or written into the stream it would reach every later value and the logits as NaN, with no
    error anywhere."""
    if isinstance(value, torch.Tensor):
        bad = value.is_floating_point() or value.is_complex()
        if not bad or value.device.type == "meta" or bool(torch.isfinite(value).all()):
            return
        count = int((~torch.isfinite(value)).sum())
        raise InvalidInput(f"{tool}'s {argument} holds {count} non-finite value(s) (NaN or ±inf) of "
                           f"{value.numel()}: it would make every value after it, and the logits, NaN. Give finite "
                           "numbers (torch.nan_to_num(x) replaces them).")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value):
        raise InvalidInput(f"{tool}'s {argument} is {value!r}: it would make every value after it, and the logits, "
                           "NaN or infinite. Give a finite number.")


def _as_index(positions: Positions) -> Any:
    if isinstance(positions, (int, slice, torch.Tensor)):
        return positions
    return list(positions)
