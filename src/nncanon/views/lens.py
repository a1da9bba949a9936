"""The logit lens view: layers x positions, each cell the lens's top next token and its probability
(`nncanon.tools.logit_lens`: every layer's output through the model's own final norm and head)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidInput
from ..tools._common import layer_list
from ..tools.logit_lens import lens_top_tokens, logit_lens
from .page import Page, render, rounded
from .text import prompt_tokens


def lens_data(tokens: Sequence[str], top_tokens: Sequence[Sequence[str]], probabilities: Any,
              layers: Sequence[int] | None = None) -> dict:
    """The page's data: ``tokens`` (the prompt's), ``top`` ``[layers][positions]`` strings, ``p`` their
    probabilities, ``layers`` the row labels.

    Raises:
        InvalidInput: a grid whose shape is not ``[len(layers), len(tokens)]`` (another prompt's or model's).
    """
    probs = torch.as_tensor(probabilities, dtype=torch.float32)
    rows = len(top_tokens)
    layers = list(range(rows)) if layers is None else list(layers)
    if probs.dim() != 2 or tuple(probs.shape) != (rows, len(tokens)) or len(layers) != rows \
            or any(len(row) != len(tokens) for row in top_tokens):
        raise InvalidInput(f"the lens grid is {list(probs.shape)} with {rows} rows of top tokens for {len(layers)} "
                           f"layers, but the prompt has {len(tokens)} tokens: it must be [layers, {len(tokens)}] "
                           "(a lens of another prompt or model?)")
    return {"tokens": [str(t) for t in tokens], "layers": layers, "top": [[str(t) for t in row] for row in top_tokens],
            "p": [[rounded(v, 3) for v in row] for row in probs.tolist()]}


def lens_page(model: Any = None, prompt: str | None = None, layers: int | Sequence[int] | None = None, *,
              tokens: Sequence[str] | None = None, top_tokens: Sequence[Sequence[str]] | None = None,
              probabilities: Any = None, title: str | None = None) -> Page:
    """The logit lens page of ``prompt`` on ``model`` (`logit_lens`, one forward), or of a given grid
    (``tokens``, ``top_tokens`` and ``probabilities`` ``[layers, positions]``, ``layers`` its row labels).

    Raises:
        InvalidInput: no model and no grid, an empty prompt, a grid of another shape than the prompt's.
    """
    if model is not None:
        tokens = prompt_tokens(model, prompt)
        indices = layer_list(model, layers)
        lens = logit_lens(model, prompt, layers=indices)[0]  # [layers, seq, vocab]
        _, probabilities, top_tokens = lens_top_tokens(model, lens)
        layers = indices
    elif tokens is None or top_tokens is None or probabilities is None:
        raise InvalidInput("lens_page takes a model and a prompt, or tokens=, top_tokens= and probabilities=")
    data = lens_data(tokens, top_tokens, probabilities, layers if not isinstance(layers, int) else [layers])
    notes = []
    missing = sum(v is None for row in data["p"] for v in row)
    if missing:
        notes.append(f"{missing} cells hold NaN probabilities (drawn hatched): the model overflowed there.")
    name = title if title is not None else f"Logit lens: {prompt!r}" if prompt else "Logit lens"
    return render("lens", name, data, notes)
