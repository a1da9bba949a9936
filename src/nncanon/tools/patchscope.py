"""Patchscopes: read a hidden state from a source prompt, patch it into a target prompt, see what it says."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..inputs import prompt_list
from ._common import checked_positions, layer_list

#: The target of the Patchscopes paper's next-token "identity" inspection: the model repeats a word.
IDENTITY_TARGET = "cat -> cat\n1135 -> 1135\nhello -> hello\n?"


def _pairs(source: str | Sequence[str], target: str | Sequence[str]) -> tuple[list[str], list[str]]:
    sources = prompt_list(source)
    targets = prompt_list(target)
    if len(targets) == 1 and len(sources) > 1:
        targets = targets * len(sources)
    if len(targets) != len(sources):
        raise ValueError(f"{len(sources)} source prompts but {len(targets)} targets: give one target or one per source")
    return sources, targets


def source_states(
    model: Any, source: str | Sequence[str], layers: Sequence[int], position: int = -1
) -> dict[int, torch.Tensor]:
    """``layers[l].layer_output[:, position]`` of the sources for each layer, ``[batch, hidden]``, one forward."""
    states: dict[int, torch.Tensor] = {}
    with torch.no_grad(), model.trace(prompt_list(source)):
        for index in sorted(set(layers)):
            output = model.layers[index].layer_output
            states[index] = output[:, checked_positions(position, output.shape[1])].save()
    return states


def patchscope(
    model: Any,
    source: str | Sequence[str],
    target: str | Sequence[str],
    layers: int | Sequence[int],
    source_position: int = -1,
    target_position: int = -1,
    target_layer: int | None = None,
) -> torch.Tensor:
    """The target's next-token distribution with a source's hidden state patched in.

    The source's ``layers[l].layer_output[:, source_position]`` replaces the target's
    ``layers[target_layer].layer_output[:, target_position]`` (``target_layer`` defaults to
    ``l``), and the target runs on from there. Two forwards: the sources once, then every layer
    of ``layers`` as one invoke of a single batched trace.

    Args:
        model: A `StandardizedTransformer`.
        source: One prompt or a batch.
        target: One prompt (used for every source) or one per source.
        layers: The source layer(s) to read.
        source_position, target_position: Positions in the (left-padded) batches; ``-1`` is each
            prompt's last token, which is why negative positions are the safe choice.
        target_layer: The layer to patch in the target (default: the source layer).

    Returns:
        Probabilities ``[batch, vocab]`` for an int ``layers``, ``[batch, len(layers), vocab]`` for a list.
    """
    sources, targets = _pairs(source, target)
    indices = layer_list(model, layers)
    states = source_states(model, sources, indices, source_position)
    fixed = None if target_layer is None else layer_list(model, target_layer)[0]
    probs: list[torch.Tensor] = []
    with torch.no_grad(), model.trace() as tracer:
        for index in indices:
            where = index if fixed is None else fixed
            with tracer.invoke(targets):
                output = model.layers[where].layer_output
                output[:, checked_positions(target_position, output.shape[1])] = states[index].to(output.dtype)
                probs.append(model.next_token_probs.save())
    stacked = torch.stack(probs, dim=1)
    return stacked[:, 0] if isinstance(layers, int) else stacked


def patchscope_generate(
    model: Any,
    source: str | Sequence[str],
    target: str | Sequence[str],
    layer: int,
    source_position: int = -1,
    target_position: int = -1,
    target_layer: int | None = None,
    max_new_tokens: int = 20,
    **generate_kwargs: Any,
) -> torch.Tensor:
    """Generate from the target with a source's hidden state patched in (at the prompt, not at new tokens).

    The patch is `patchscope`'s, written once on the prompt's forward; generation then runs on
    from the patched state (its cache holds the patched keys and values).

    Returns:
        The token ids ``[batch, prompt + new]`` (``model.tokenizer.batch_decode`` turns them into text).
    """
    sources, targets = _pairs(source, target)
    index = layer_list(model, layer)[0]
    states = source_states(model, sources, [index], source_position)
    where = index if target_layer is None else layer_list(model, target_layer)[0]
    with torch.no_grad(), model.generate(targets, max_new_tokens=max_new_tokens, **generate_kwargs) as tracer:
        output = model.layers[where].layer_output
        output[:, checked_positions(target_position, output.shape[1])] = states[index].to(output.dtype)
        ids = tracer.result.save()
    return ids
