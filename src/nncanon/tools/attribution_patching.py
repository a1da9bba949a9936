"""Attribution patching: the first-order estimate of every head's and sublayer's patching effect.

Patching value ``a`` of the clean run with its value ``a'`` in the corrupted run moves a metric ``M``
by ``M(a') - M(a)``; to first order that is ``(a' - a) · ∂M/∂a``, the gradient taken on the clean run.
One clean forward (with gradients), one corrupted forward and one backward give the estimate for
every head and sublayer of every layer at once, where exact patching costs a forward for each.
With no corrupted prompt, ``a' = 0``: the estimate of zero-ablating each one (``nncanon ablate --fast``).

The gradients are nnsight's ``value.grad`` in a ``with loss.backward():`` block of the clean trace
(see the gradients page of the docs). The backward runs from the stream entering the first block:
the model's weights get no gradient, and nothing of theirs is left behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._common import in_execution_order, prompt_list, read, token_count

#: What `attribution_patching` can estimate: each head, the block's token mixer, its MLP.
OVER = ("heads", "attention", "mlp")

#: For each item of `OVER`, the standard values that stand for it, in order of preference: a block
#: serves the first it has (a hybrid's linear mixer stands for attention where it has no softmax attention).
_VALUES = {
    "heads": ("attention_head_outputs", "linear_attention_head_outputs"),
    "attention": ("attention_output", "linear_attention_output"),
    "mlp": ("mlp_output",),
}


@dataclass
class AttributionPatching:
    """The estimates of `attribution_patching`, labelled.

    Attributes:
        heads: ``[*batch, layers, heads]``: each head's estimated effect on the metric; NaN where a layer
            has no per-head values or fewer heads than the widest (``None`` unless asked for).
        attention: ``[*batch, layers]``: the token mixer's (softmax attention, or a hybrid block's linear mixer).
        mlp: ``[*batch, layers]``: the MLP's; NaN where a block has none.
        values: ``{"heads": [...], "attention": [...], "mlp": [...]}``: the standard value each layer's
            estimate is of (``None`` where the layer has none).
        batch: Whether the leading batch axis is there (prompts given as a list).
    """

    heads: torch.Tensor | None
    attention: torch.Tensor | None
    mlp: torch.Tensor | None
    values: dict[str, list[str | None]]
    batch: bool

    def __getitem__(self, item: str) -> torch.Tensor:
        """``result["heads"]``: the estimates for one item of `OVER`."""
        if item not in OVER or getattr(self, item) is None:
            asked = [name for name in OVER if getattr(self, name) is not None]
            raise KeyError(f"{item!r} was not estimated; this result has {asked}")
        return getattr(self, item)


def _plan(model: Any, over: Sequence[str]) -> dict[int, dict[str, str]]:
    """``{layer: {item: standard value}}`` for the items of ``over`` each layer serves."""
    report = model.support()
    plan: dict[int, dict[str, str]] = {}
    for layer in range(model.num_layers):
        chosen = {}
        for item in over:
            value = next((v for v in _VALUES[item] if report.available(v, layer=layer)), None)
            if value is not None:
                chosen[item] = value
        plan[layer] = chosen
    return plan


@contextlib.contextmanager
def _no_weight_gradients(model: Any) -> Iterator[None]:
    """The model's parameters take no gradient for the duration (restored after)."""
    parameters = [p for p in model._module.parameters() if p.requires_grad]
    for parameter in parameters:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in parameters:
            parameter.requires_grad_(True)


def _corrupted_values(model: Any, prompts: list[str], order: list[tuple[int, str]]) -> dict:
    saved: dict = {}
    with torch.no_grad(), model.trace(prompts):
        for layer, name in order:
            saved[(layer, name)] = read(model, layer, name).save()
    return saved


def _clean_values_and_gradients(model: Any, prompts: list[str], order: list[tuple[int, str]],
                                metric: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict, dict]:
    values: dict = {}
    grads: dict = {}
    # No cache: a recurrent model that updates its cached state in place (RWKV) has no backward then.
    with torch.enable_grad(), _no_weight_gradients(model), model.trace(prompts, use_cache=False):
        stream = model.layers[0].layer_input
        # The backward starts here: a leaf with the stream's data (the weights take no gradient).
        model.layers[0].layer_input = stream.detach().requires_grad_(True)
        for layer, name in order:
            values[(layer, name)] = read(model, layer, name)
        loss = metric(model.logits).sum()
        with loss.backward():
            for key in reversed(order):
                grads[key] = values[key].grad.detach().save()
        for key in order:
            values[key] = values[key].detach().save()
    return values, grads


def attribution_patching(
    model: Any,
    clean: str | Sequence[str],
    corrupted: str | Sequence[str] | None,
    metric: Callable[[torch.Tensor], torch.Tensor],
    over: Sequence[str] = OVER,
) -> AttributionPatching:
    """The linear estimate of patching each head and sublayer of every layer from ``corrupted`` into ``clean``.

    For a value ``a`` (a head's output ``[b, s, head_dim]``, a sublayer's contribution ``[b, s, d]``),
    the estimate is ``Σ_positions,features (a_corrupted - a_clean) · ∂metric/∂a`` at the clean run: the
    first-order term of the change of ``metric`` when the corrupted value replaces the clean one at every
    position. Two forwards and one backward for every layer at once.

    Args:
        model: A `StandardizedTransformer`.
        clean: The prompt (or prompts) whose run is patched; the gradient is taken there.
        corrupted: The prompt (or prompts) the patched values come from, of the same token length as
            ``clean``; ``None``: zero (the estimate of zero-ablating each one).
        metric: The clean run's logits ``[batch, seq, vocab]`` to one number per prompt ``[batch]`` (or a
            scalar): e.g. `logit_difference`, or ``lambda logits: logits[:, -1].softmax(-1)[:, token]``.
        over: Which of ``"heads"``, ``"attention"`` (the block's token mixer) and ``"mlp"`` to estimate.

    Returns:
        An `AttributionPatching`: ``heads`` ``[layers, heads]``, ``attention`` and ``mlp`` ``[layers]``,
        with a leading batch axis when the prompts are a list (the estimate for each prompt).

    Example:
        >>> result = attribution_patching(model, "The Eiffel Tower is in the city of", None,
        ...                               lambda logits: logits[:, -1, paris])
        >>> result.heads      # [layers, heads]: the estimated change of the logit when each head is zeroed
    """
    unknown = [item for item in over if item not in OVER]
    if unknown or not over:
        raise ValueError(f"over={tuple(over)!r}: choose among {OVER}")
    batch = prompt_list(clean)
    if corrupted is not None:
        if isinstance(clean, str) != isinstance(corrupted, str) or len(prompt_list(corrupted)) != len(batch):
            raise ValueError("clean and corrupted must be two prompts or two lists of the same length")
        lengths = token_count(model, clean), token_count(model, corrupted)
        if lengths[0] != lengths[1]:
            raise ValueError(
                f"clean and corrupted prompts tokenize to {lengths[0]} and {lengths[1]} tokens: positions must "
                "line up, so attribution patching needs prompts of the same length"
            )
    plan = _plan(model, over)
    order = [(layer, name) for layer, chosen in plan.items()
             for name in in_execution_order(model, layer, list(chosen.values()))]
    if not order:
        raise ValueError(f"no layer of this model serves any of {tuple(over)}: see model.support()")
    values, grads = _clean_values_and_gradients(model, batch, order, metric)
    patched = _corrupted_values(model, prompt_list(corrupted), order) if corrupted is not None else None
    estimates = {}
    for key in order:
        delta = (patched[key] if patched is not None else torch.zeros_like(values[key])) - values[key]
        product = (delta.float() * grads[key].float())
        # heads [b, s, H, head_dim] -> [b, H]; a contribution [b, s, d] (or [b, s, k·d] on k streams) -> [b]
        heads = key[1].endswith("head_outputs")
        estimates[key] = product.sum(dim=(1, -1)) if heads else product.flatten(1).sum(-1)
    return _labelled(model, plan, over, estimates, len(batch), not isinstance(clean, str))


def _labelled(model: Any, plan: dict, over: Sequence[str], estimates: dict, size: int,
              batched: bool) -> AttributionPatching:
    layers = model.num_layers
    fields: dict[str, Any] = {item: None for item in OVER}
    names: dict[str, list[str | None]] = {}
    for item in over:
        names[item] = [plan[layer].get(item) for layer in range(layers)]
        if item == "heads":
            width = max((estimates[(layer, name)].shape[-1] for layer, name in enumerate(names[item]) if name),
                        default=0)
            grid = torch.full((size, layers, width), float("nan"))
            for layer, name in enumerate(names[item]):
                if name:
                    row = estimates[(layer, name)]
                    grid[:, layer, : row.shape[-1]] = row
        else:
            grid = torch.full((size, layers), float("nan"))
            for layer, name in enumerate(names[item]):
                if name:
                    grid[:, layer] = estimates[(layer, name)]
        fields[item] = grid if batched else grid[0]
    return AttributionPatching(fields["heads"], fields["attention"], fields["mlp"], names, batched)


__all__ = ["OVER", "AttributionPatching", "attribution_patching"]
