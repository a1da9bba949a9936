"""Sweeps that share a prompt's forward: run the blocks before a layer once, then resume there.

A sweep that intervenes at block ``L`` (every head of ``L`` zeroed in turn, say) computes the same
blocks ``0..L-1`` for every item: their input is the same prompt and nothing has been written yet.
`streams_entering` runs those blocks once and keeps the stream entering each layer of interest;
`resume_at`, inside an invoke, skips blocks ``0..L-1`` (``model.skip_layers``) and hands block ``L``
that stream, so each item computes only blocks ``L..`` and the head. `next_token_only` asks the
model for the last position's logits only, when a sweep needs no others.

On the same prompt the resumed forward is the forward: blocks ``L..`` see the stream they would have
seen (tested on every registered family).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from .inputs import prompt_list


def streams_entering(model: Any, prompts: str | Sequence[str], layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """``{layer: layers[layer].layer_input}`` of ``prompts``, ``[batch, seq, hidden]`` each, from one forward.

    The forward stops after the last block it needs (layer 0's input needs no block).
    """
    wanted = sorted(set(layers))
    streams: dict[int, torch.Tensor] = {}
    if not wanted:
        return streams
    with torch.no_grad(), model.trace(prompt_list(prompts)) as tracer:
        for layer in wanted:
            streams[layer] = model.layers[layer].layer_input.save()
        tracer.stop()
    return streams


def resume_at(model: Any, layer: int, stream: torch.Tensor) -> None:
    """Inside an invoke: blocks ``0..layer-1`` do not run and block ``layer`` receives ``stream``.

    ``stream`` is `streams_entering`'s ``[batch, seq, hidden]`` for this invoke's prompts. Every
    invoke of the trace must resume at the same layer (a skip covers every row).

    Raises:
        ValueNotAvailable: where the family declines ``resume`` (``model.support().model_declines``).
    """
    model._model_value_check("resume")
    if layer > 0:
        # A copy (a block may update its input in place, and the stream serves every invoke), on the device
        # the first block's input is on: the skip hands it to the blocks there (models split over devices).
        entering = model.layers[0].layer_input
        model.skip_layers(0, layer - 1, skip_with=stream.to(device=entering.device, copy=True))
        # What a model does between blocks (RWKV halves the stream every few blocks) ran on the
        # skipped block's output: block `layer` gets the stream as it was recorded.
        model.layers[layer].layer_input[:] = stream


def next_token_only(model: Any) -> dict[str, int]:
    """Trace keyword arguments that make the model compute the last position's logits only.

    ``{"logits_to_keep": 1}`` where the model's forward takes it (``model.logits`` is then
    ``[batch, 1, vocab]``), ``{}`` where it does not (its logits stay ``[batch, seq, vocab]``).
    Either way ``model.logits[:, -1]`` and ``model.next_token_probs`` are the same.
    """
    forward = inspect.signature(type(model._module).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in forward else {}


__all__ = ["next_token_only", "resume_at", "streams_entering"]
