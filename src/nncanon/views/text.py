"""Tokens and contexts as the pages show them (the pages escape them: these are plain strings)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidInput

#: Where `nncanon.sae.tools.TopContexts.contexts` marks the context's token.
MARK_OPEN, MARK_CLOSE = "[[", "]]"


def token_strings(ids: Sequence[int], tokenizer: Any = None) -> list[str]:
    """Each id decoded alone (``"#id"`` without a tokenizer)."""
    if tokenizer is None:
        return [f"#{int(i)}" for i in ids]
    return [tokenizer.decode([int(i)]) for i in ids]


def prompt_tokens(model: Any, prompt: str) -> list[str]:
    """The prompt's tokens as the model runs them (special tokens included), each decoded alone."""
    if not isinstance(prompt, str) or not prompt:
        raise InvalidInput("a view takes one non-empty prompt string")
    return token_strings(model.tokenizer(prompt)["input_ids"], model.tokenizer)


def context_record(value: float, text: str) -> list:
    """``[activation, left, token, right]`` of a ``"left[[token]]right"`` context (no mark: all of it left)."""
    value = float(value)
    start, end = text.find(MARK_OPEN), text.rfind(MARK_CLOSE)
    if start < 0 or end < start:
        return [value if math.isfinite(value) else None, text, "", ""]
    return [value if math.isfinite(value) else None, text[:start], text[start + 2:end], text[end + 2:]]
