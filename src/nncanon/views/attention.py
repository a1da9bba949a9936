"""The attention pattern view: every layer's and head's ``attention_probabilities``, tokens on both axes.

Read in one trace from the surface (`model.support()` says where a layer serves softmax attention probabilities);
a layer without them (a linear mixer, a state-space block) is drawn as a line giving the family's reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import InvalidInput
from ..tools._common import layer_list
from .page import Page, render
from .text import prompt_tokens

VALUE = "attention_probabilities"


def read_patterns(model: Any, prompt: str, layers: int | Sequence[int] | None = None
                  ) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
    """``({layer: [heads, q, k]}, {layer: why not served})`` of ``prompt`` at ``layers`` (default: all), in one
    forward."""
    report = model.support()
    saved: dict[int, Any] = {}
    reasons: dict[int, str] = {}
    chosen = layer_list(model, layers)
    served = [layer for layer in chosen if report.available(VALUE, layer=layer)]
    for layer in chosen:
        if layer not in served:
            reasons[layer] = report.reason(VALUE, layer) or "this layer serves no attention probabilities"
    if served:
        with torch.no_grad(), model.trace(prompt):
            for layer in served:
                saved[layer] = model.layers[layer].self_attn.attention_probabilities[0].save()
    return {layer: value.float().cpu() for layer, value in saved.items()}, reasons


def attention_data(tokens: Sequence[str], patterns: Mapping[int, torch.Tensor],
                   reasons: Mapping[int, str] | None = None) -> dict:
    """The page's data: ``tokens``, and per layer (in order) its ``heads`` (``[H][q][k]``, 3 decimals) or ``reason``.

    Raises:
        InvalidInput: a pattern that is not ``[heads, n, n]`` with ``n = len(tokens)`` (another prompt's or model's).
    """
    tokens = [str(t) for t in tokens]
    reasons = dict(reasons or {})
    layers = []
    for layer in sorted(set(patterns) | set(reasons)):
        if layer not in patterns:
            layers.append({"layer": layer, "reason": reasons[layer]})
            continue
        value = torch.as_tensor(patterns[layer]).float()
        if value.dim() == 4 and value.shape[0] == 1:
            value = value[0]
        if value.dim() != 3 or tuple(value.shape[1:]) != (len(tokens), len(tokens)):
            raise InvalidInput(
                f"the attention pattern of layer {layer} is {list(value.shape)}, but the prompt has {len(tokens)} "
                f"tokens: a pattern must be [heads, {len(tokens)}, {len(tokens)}] (one from another prompt or model?)")
        nan = int(torch.isnan(value).sum())
        heads = torch.round(value * 1000).div(1000).tolist()
        layers.append({"layer": layer, "heads": heads, "nan": nan})
    return {"tokens": tokens, "layers": layers}


def attention_page(model: Any = None, prompt: str | None = None, layers: int | Sequence[int] | None = None, *,
                   tokens: Sequence[str] | None = None,
                   patterns: Mapping[int, torch.Tensor] | None = None, reasons: Mapping[int, str] | None = None,
                   title: str | None = None) -> Page:
    """The attention page of ``prompt`` on ``model`` at ``layers`` (default: all; read with `read_patterns`), or of
    given ``tokens`` and ``patterns`` (``{layer: [heads, n, n]}``, ``reasons``: ``{layer: why no pattern}``).

    The page holds every value (about 6 bytes each: layers x heads x n²), so for a large model and a long prompt
    choose ``layers``.

    Raises:
        InvalidInput: no model and no patterns, an empty prompt, patterns of another prompt's length.
    """
    if model is not None:
        tokens = prompt_tokens(model, prompt)
        patterns, reasons = read_patterns(model, prompt, layers)
    elif patterns is None or tokens is None:
        raise InvalidInput("attention_page takes a model and a prompt, or tokens= and patterns=")
    data = attention_data(tokens, patterns, reasons)
    notes = []
    if not any("heads" in layer for layer in data["layers"]):
        notes.append("No layer serves softmax attention probabilities: there is no pattern to draw.")
    for layer in data["layers"]:
        if layer.get("nan"):
            notes.append(f"Layer {layer['layer']}'s pattern holds {layer['nan']} NaN values (drawn hatched).")
    name = title if title is not None else f"Attention patterns: {prompt!r}" if prompt else "Attention patterns"
    return render("attention", name, data, notes)
