"""A trace's inputs: prompts as a list, and the refusals of inputs the model cannot run, by name (no prompt, an
empty row, ids outside the vocabulary, a prompt longer than the positions, inputs that would run idle blocks)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode  # (torch's: a fake tensor mode is active while nnsight scans)

from .errors import InvalidInput

#: What a trace, an invoke and a tool take as prompts.
_PROMPTS = ("a string, a list of strings, or token ids (a tensor [batch, seq], a list of ints, or the tokenizer's "
            "output)")


def prompt_list(prompts: str | Sequence[str]) -> list[str]:
    """One prompt or several, as a list; `InvalidInput` for what is neither (``None``, a number)."""
    if isinstance(prompts, str):
        return [prompts]
    if prompts is None or not isinstance(prompts, (Sequence, torch.Tensor)):
        raise InvalidInput(f"the prompts given are {_shown(prompts)}: give {_PROMPTS}.")
    return list(prompts)


def refuse_no_prompt(inputs: tuple) -> None:
    """Refuse an invoke with no prompt at all (``None``, ``[]``), or with something no tokenizer takes (a number),
    by name."""
    if not inputs:
        return
    given = inputs[0]
    if given is None or (isinstance(given, (list, tuple)) and len(given) == 0):
        raise InvalidInput(
            f"model.trace / model.generate was given {given!r}: there is no prompt to run. Give a "
            "string, a list of strings, or token ids; to batch with invokes, call model.trace() with "
            "no input and tracer.invoke(prompt) inside."
        )
    if not isinstance(given, (str, Sequence, Mapping, torch.Tensor)):
        raise InvalidInput(f"model.trace / model.generate was given {_shown(given)}: give {_PROMPTS}.")


def _shown(value: object) -> str:
    """``value`` and its type, for a message (cut short)."""
    text = repr(value)
    return f"{text if len(text) < 80 else text[:77] + '...'} ({type(value).__name__})"


def check_batch(model: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a batched forward input (``args``, ``kwargs``: nnsight's batch of the invokes' inputs) with an
    empty row, token ids the embedding has no row for, a prompt longer than the model's positions, or an argument
    that would run blocks served as idle."""
    refuse_idle_inputs(model, kwargs)
    # Under nnsight's scan (fake tensors) there are no values to check; the real trace checks them.
    real = detect_fake_mode() is None
    if args and isinstance(args[0], torch.Tensor):  # nnsight passes a float tensor on as it is: the ids' place
        check_token_ids(model, args[0], real)
    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    if isinstance(ids, torch.Tensor):
        check_token_ids(model, ids, real)
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        masked = isinstance(mask, torch.Tensor) and real
        lengths = mask.sum(-1).tolist() if masked else [ids.shape[1]] * ids.shape[0]
        empty = [row for row, length in enumerate(lengths) if length == 0]
        if empty:
            raise InvalidInput(
                f"batch row(s) {empty} have no tokens: an empty prompt, and this tokenizer adds no BOS "
                "token, so the model would predict from padding only. Give every prompt at least one "
                "token (or a tokenizer that adds a BOS token)."
            )
        limit = position_limit(model)
        if limit is not None and ids.shape[1] > limit:
            raise InvalidInput(
                f"the prompt is {ids.shape[1]} tokens long, but this {model._text_config.model_type} model "
                f"has {limit} positions (a learned position table of {limit} rows): give at most {limit} "
                "tokens, e.g. tokenizer(..., truncation=True, max_length=...)."
            )


def check_token_ids(model: Any, ids: torch.Tensor, real: bool) -> None:
    """Refuse token ids that are not integers, or (``real``: values to read) have no row in the embedding."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InvalidInput(
            f"the token ids are a {ids.dtype} tensor: token ids are integers (torch.long), indices into "
            "the model's embedding. Pass ids.long(), or the text itself."
        )
    rows = getattr(model.embed_tokens._module, "num_embeddings", None)
    if not real or ids.numel() == 0 or not isinstance(rows, int):
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= rows:
        bad = sorted({int(i) for i in ids[(ids < 0) | (ids >= rows)].unique()[:5]})
        raise InvalidInput(
            f"token id(s) {bad} are outside this model's vocabulary: its embedding has {rows} rows, so an "
            f"id is in 0..{rows - 1}. Tokenize with model.tokenizer (ids of another tokenizer do not fit "
            "this model)."
        )


def refuse_idle_inputs(model: Any, kwargs: dict) -> None:
    """Refuse a forward argument that would run the blocks the family serves as idle (`Family.idle_inputs`)."""
    given = [name for name in model._family.idle_inputs if kwargs.get(name) is not None]
    if given:
        idle = [i for i in range(model.num_layers) if model._family.idle_reason(model._text_config, i) is not None]
        raise InvalidInput(
            f"this {model._text_config.model_type} model was given {', '.join(given)}: with it the model runs "
            f"blocks {idle}, which nncanon serves as idle blocks (the stream passes them; "
            f"{model._family.idle_reason(model._text_config, idle[0])}). nncanon serves the text path: trace "
            "text alone, or use the transformers model directly for image inputs."
        )


def position_limit(model: Any) -> int | None:
    """The longest sequence the model can embed, where it has a learned position table (GPT-2's ``n_positions``)."""
    if "_position_limit_cache" not in model.__dict__:
        config = model._text_config
        limit = getattr(config, "n_positions", None)
        most = getattr(config, "max_position_embeddings", None)
        if limit is None and isinstance(most, int):
            token_table = model.embed_tokens._module
            tables = [m for m in model._module.modules() if isinstance(m, torch.nn.Embedding)]
            # a learned position table (OPT offsets its rows by 2)
            if any(m.num_embeddings in (most, most + 2) for m in tables if m is not token_table):
                limit = most
        model.__dict__["_position_limit_cache"] = limit
    return model.__dict__["_position_limit_cache"]
