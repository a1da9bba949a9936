"""Ablation: zero or mean ablation of heads, attention, MLPs and whole blocks (the ablation page's recipes).

The ``*_ablate*`` functions are called inside a trace (inside one invoke: they touch that invoke's
rows only); `mean_values` runs its own forward over a reference set. What each value means:

- ``"attention_head_outputs"`` with ``heads``: head ``h``'s output before the output projection
  (zero it and the head adds nothing);
- ``"attention_output"`` / ``"mlp_output"``: exactly what the sublayer adds to the stream (a hybrid's
  ``"linear_attention_output"`` / ``"linear_attention_head_outputs"`` likewise);
- ``"neurons"`` with ``neurons``: the MLP's neurons, what its down projection receives (zero neuron ``n`` and the
  down projection sees 0 in its column ``n``, exactly as a plain pre-hook on it would);
- ``"block"``: the whole block's contribution, ``layer_output - layer_input``. Zero-ablating it
  passes the stream through unchanged, like ``model.skip_layers`` but inside one invoke (the block
  still runs; `skip_blocks` saves the compute, in a trace of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import InvalidInput
from ..inputs import prompt_list
from ..reading import check_value, head_count, host
from ..resuming import next_token_only, resume_at, streams_entering
from ..traced import refuse_outside_trace
from ._common import (
    Positions,
    _as_index,
    check_indices,
    checked_positions,
    finite,
    none_serves,
    one_prompts,
    serving,
)

#: The values these helpers ablate.
ABLATABLE = (
    "attention_head_outputs",
    "attention_output",
    "linear_attention_head_outputs",
    "linear_attention_output",
    "mlp_output",
    "neurons",
    "block",
)


def _support_name(value: str) -> str:
    return "layer_output" if value == "block" else value


def _index(positions: Positions, heads: int | Sequence[int] | None, value: str) -> tuple:
    if heads is not None and not value.endswith("head_outputs") and value != "neurons":
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
    refuse_outside_trace(model, "an ablation (zero_ablate, mean_ablate and the like) was called")
    finite("mean_ablate", "mean", replacement)
    where = _index(positions, heads, value)
    if value == "block":
        block = model.layers[layer]
        entering = block.layer_input.clone()
        leaving = block.layer_output
        if positions is not None:
            checked_positions(positions, leaving.shape[1])
        if isinstance(replacement, torch.Tensor):
            _check_mean(replacement, leaving, layer, value)
            replacement = replacement.to(device=leaving.device, dtype=leaving.dtype)
        leaving[where] = entering[where] + replacement
        return
    target = getattr(host(model, layer, value), value)
    if positions is not None:
        checked_positions(positions, target.shape[1])
    if heads is not None:
        count = target.shape[2]
        units = "neurons" if value == "neurons" else "heads"
        check_indices([heads] if isinstance(heads, int) else list(heads), count, units,
                      f"layers[{layer}] has {count} {units}")
    if isinstance(replacement, torch.Tensor):
        _check_mean(replacement, target, layer, value)
        replacement = replacement.to(device=target.device, dtype=target.dtype)
        if heads is not None and replacement.dim() >= 1 + (value != "neurons"):  # the means of these heads/neurons
            replacement = replacement[heads if isinstance(heads, int) else list(heads)]
    target[where] = replacement


def _check_mean(mean: torch.Tensor, target: torch.Tensor, layer: int, value: str) -> None:
    """Raise `InvalidInput` unless ``mean`` is 0-d or one position of ``target`` ([hidden], [heads, head_dim])."""
    if mean.dim() > 0 and mean.shape != target.shape[2:]:  # (a 0-d tensor: one number everywhere)
        raise InvalidInput(f"the mean is {tuple(mean.shape)}; layers[{layer}] {value} is {tuple(target.shape[2:])} "
                           f"at each position: pass mean_values(model, prompts, {value!r})[{layer}]")


def zero_ablate(
    model: Any,
    layer: int,
    value: str,
    heads: int | Sequence[int] | None = None,
    positions: Positions = None,
    neurons: int | Sequence[int] | None = None,
) -> None:
    """Zero ``value`` of block ``layer`` (at ``positions``; for heads, of ``heads``; for neurons, of ``neurons``) in
    this invoke; inside a trace.

    ``value`` is one of ``"attention_head_outputs"`` (with ``heads``), ``"attention_output"``,
    ``"mlp_output"``, ``"neurons"`` (with ``neurons``, else all of them) or ``"block"`` (the block adds nothing:
    its output is its input).
    """
    _ablate(model, layer, value, 0.0, _units(value, heads, neurons), positions)


def mean_ablate(
    model: Any,
    layer: int,
    value: str,
    mean: torch.Tensor,
    heads: int | Sequence[int] | None = None,
    positions: Positions = None,
    neurons: int | Sequence[int] | None = None,
) -> None:
    """Replace ``value`` of block ``layer`` by ``mean`` (from `mean_values`) in this invoke; inside a trace.

    ``mean`` is ``[hidden]`` (``[heads, head_dim]`` for ``attention_head_outputs``: the rows of
    ``heads`` are used; ``[d_mlp]`` for ``neurons``: the entries of ``neurons``). For ``"block"`` the block's
    output becomes its input plus the mean contribution.
    """
    _ablate(model, layer, value, mean, _units(value, heads, neurons), positions)


def _units(value: str, heads: Any, neurons: Any) -> Any:
    """The heads or neurons an ablation selects (``neurons=`` for ``"neurons"``, ``heads=`` for the heads)."""
    if neurons is not None and value != "neurons":
        raise ValueError(f"neurons= applies to the value 'neurons' only, not {value!r}")
    if heads is not None and value == "neurons":
        raise ValueError("the value 'neurons' takes neurons=, not heads=")
    return heads if neurons is None else neurons


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
        value: ``"attention_head_outputs"``, ``"attention_output"``, ``"mlp_output"``, ``"neurons"`` or ``"block"``.
        layers: The layers (default: every layer that serves ``value``, per ``model.support()``).
        positions: ``-1`` (default: every prompt's last token), other positions of the padded batch,
            or ``None``: every real (non-padding) token of every prompt.

    Returns:
        ``{layer: mean}``, each ``[hidden]`` (``[heads, head_dim]`` for head outputs, ``[d_mlp]`` for neurons).
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
        picked = raw[index][:, checked_positions(positions, raw[index].shape[1])]
        if picked.dim() == raw[index].dim():  # several positions: average them too
            picked = picked.flatten(0, 1)
        means[index] = picked.mean(0)
    return means


def zero_ablate_heads(model: Any, layer: int, heads: int | Sequence[int], positions: Positions = None) -> None:
    """Zero heads ``heads`` of block ``layer`` (their outputs before the projection); inside a trace."""
    zero_ablate(model, layer, "attention_head_outputs", heads=heads, positions=positions)


def zero_ablate_neurons(model: Any, layer: int, neurons: int | Sequence[int], positions: Positions = None) -> None:
    """Zero neurons ``neurons`` of block ``layer``'s MLP (what its down projection receives, ``mlp.neurons``) in this
    invoke; inside a trace. The same as a plain pre-hook on the down projection zeroing those columns."""
    zero_ablate(model, layer, "neurons", positions=positions, neurons=neurons)


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


def _probabilities(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1)


def _check_means(model: Any, mean: dict[int, torch.Tensor], indices: list[int], value: str) -> None:
    """Raise `InvalidInput` unless ``mean`` has a ``[heads, head_dim]`` mean of ``value`` for every layer swept."""
    for layer in indices:
        found = mean.get(layer)
        finite("head_ablation_sweep", f"mean[{layer}]", found)
        if found is None:
            raise InvalidInput(f"mean= has no entry for layers[{layer}] (it has {sorted(mean)}): pass "
                               f"mean_values(model, prompts, {value!r}) for the layers swept")
        count = head_count(model, layer, value)
        if found.dim() != 2 or found.shape[0] != count:
            raise InvalidInput(f"mean[{layer}] is {tuple(found.shape)}; a head sweep replaces each head by its mean "
                               f"[heads, head_dim] = [{count}, ...]: pass mean_values(model, prompts, {value!r})")


def head_ablation_sweep(
    model: Any,
    prompts: str | Sequence[str],
    layers: int | Sequence[int] | None = None,
    value: str = "attention_head_outputs",
    metric: Callable[[torch.Tensor], torch.Tensor] = _probabilities,
    mean: dict[int, torch.Tensor] | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """Every head of ``layers`` ablated in turn: ``metric`` of the next-token logits with each one zeroed.

    One invoke per head, ``batch_size`` invokes per trace, one trace (or more) per layer. The blocks
    before a layer run once for the whole sweep (`streams_entering`), and each trace resumes at its
    layer (`resume_at`) and computes the last position's logits only (`next_token_only`). Each
    item equals a trace of its own with that head zeroed (up to the last bit where a model's
    kernels depend on the batch size).

    Args:
        model: A `StandardizedTransformer`.
        prompts: One prompt or several (left-padded in one batch; every invoke runs all of them).
        layers: The layers (default: every layer that serves ``value``, per ``model.support()``).
        value: ``"attention_head_outputs"`` or ``"linear_attention_head_outputs"``.
        metric: Maps the next-token logits ``[batch, vocab]`` to what is recorded (default: the
            probabilities, ``softmax``). It sees the last position only.
        mean: ``{layer: [heads, head_dim]}`` from `mean_values`: mean-ablate instead of zeroing (one for every
            layer swept, else `InvalidInput`).
        batch_size: Invokes per trace (memory: each is one copy of the batch).

    Returns:
        ``[len(layers), heads, *metric]``, NaN where a layer has fewer heads than the widest; the batch
        axis of ``metric`` is dropped for a single prompt (a string).

    Example:
        >>> probs = head_ablation_sweep(model, "The Eiffel Tower is in the city of", layers=[0, 1])
        >>> effect = probs[..., paris] - clean_probability   # [2, heads]
    """
    check_value(value, ("attention_head_outputs", "linear_attention_head_outputs"))
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    indices = serving(model, value, layers)
    if not indices:
        raise none_serves(model, value)
    if mean is not None:
        _check_means(model, mean, indices, value)
    batch = prompt_list(prompts)
    streams = streams_entering(model, batch, indices)
    keep = next_token_only(model)
    rows: list[list[torch.Tensor]] = []
    for layer in indices:
        count = head_count(model, layer, value)
        row: list[torch.Tensor] = []
        for start in range(0, count, batch_size):
            with torch.no_grad(), model.trace(**keep) as tracer:
                for head in range(start, min(start + batch_size, count)):
                    with tracer.invoke(batch):
                        resume_at(model, layer, streams[layer])
                        replacement = 0.0 if mean is None else mean[layer]
                        _ablate(model, layer, value, replacement, head, None)
                        row.append(metric(model.logits[:, -1]).save())
        rows.append(row)
    results = [torch.stack([one_prompts(item, prompts) for item in row]) for row in rows]
    width = max(len(row) for row in results)
    if all(len(row) == width for row in results):
        return torch.stack(results)
    out = torch.full((len(results), width, *results[0].shape[1:]), float("nan"), dtype=torch.result_type(
        results[0], 0.5))
    for index, row in enumerate(results):
        out[index, : len(row)] = row
    return out


__all__ = [
    "ABLATABLE",
    "head_ablation_sweep",
    "mean_ablate",
    "mean_values",
    "skip_blocks",
    "zero_ablate",
    "zero_ablate_attention",
    "zero_ablate_block",
    "zero_ablate_heads",
    "zero_ablate_mlp",
]
