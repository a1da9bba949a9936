"""Attribution patching: the first-order estimate of every head's and sublayer's patching effect.

Patching value ``a`` of the clean run with its value ``a'`` in the corrupted run moves a metric ``M``
by ``M(a') - M(a)``; to first order that is ``(a' - a) · ∂M/∂a``, the gradient taken on the clean run.
One clean forward (with gradients), one corrupted forward and one backward give the estimate for
every head and sublayer of every layer at once, where exact patching costs a forward for each.
With no corrupted prompt, ``a' = 0``: the estimate of zero-ablating each one (``nncanon ablate --fast``).

The gradients are taken inside the clean trace by one ``torch.autograd.grad`` of the metric with
respect to the served values (the same gradients as ``value.grad`` in a ``with loss.backward():`` block,
see the gradients page of the docs, without a hook per value). The stream entering the first block is
a leaf that requires a gradient, the model's weights do not: the backward computes the gradients of
the values asked for and nothing below the earliest of them, and leaves nothing on the weights. Where the
head is a plain linear map and the metric depends on a few logits (a logit difference), the head's backward is
computed for those logits' rows of the weight only (`_through_head`): the same gradients, without a pass over
the ``[vocab, hidden]`` matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import GradientNotAvailable, InvalidInput
from ..gradients import no_weight_gradients
from ..inputs import prompt_list
from ..quantization import is_quantized
from ..reading import in_execution_order, read
from ..resuming import next_token_only as next_token_kwargs
from ._common import check_pair, none_serves

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
            if value is None:
                continue
            refused = report.gradient_reason(value, layer)
            if refused is not None:  # its gradient check failed on the load-time proof
                raise GradientNotAvailable(
                    f"layers[{layer}].{value}'s gradient is not served ({refused}), so attribution patching "
                    f"cannot estimate {item!r} there; leave {item!r} out of over= (see model.support())"
                )
            chosen[item] = value
        plan[layer] = chosen
    return plan


def _linear_head(model: Any) -> torch.nn.Linear | None:
    """The model's ``lm_head`` where it is a plain `torch.nn.Linear` with a float weight (``None`` otherwise: a
    quantized head takes its own backward)."""
    module = getattr(model.lm_head, "_module", None) if model.lm_head is not None else None
    return module if type(module) is torch.nn.Linear and not is_quantized(module) else None


def _through_head(loss: torch.Tensor, values: list[torch.Tensor], entering: torch.Tensor, leaving: torch.Tensor,
                  weight: torch.Tensor) -> tuple:
    """``torch.autograd.grad(loss, values)``, the unembedding's backward computed for the logits the loss
    depends on only.

    A metric of a few logits (a logit difference) has a gradient that is zero on every other column of the
    vocabulary, but the backward of the head (``logits = entering @ weight.T + bias``) multiplies the whole
    ``[*, vocab]`` gradient by the ``[vocab, hidden]`` weight: a pass over the largest matrix of most models
    for nothing. So the gradient is taken in three steps: the metric's to the head's output (``[*, vocab]``),
    its product with the weight's rows where it is not zero (the columns where it is zero add exactly 0),
    and from the head's input to the values. A metric of every logit (a softmax) takes the head's own backward.
    """
    (outward,) = torch.autograd.grad(loss, leaving, retain_graph=True, allow_unused=True)
    if outward is None:  # the metric does not go through the head: nothing to spare
        return torch.autograd.grad(loss, values, allow_unused=True)
    columns = outward.detach().flatten(0, -2).ne(0).any(0).nonzero()[:, 0]
    if 8 * columns.numel() > weight.shape[0]:
        return torch.autograd.grad(leaving, values, grad_outputs=outward, allow_unused=True)
    inward = outward.index_select(-1, columns) @ weight.index_select(0, columns)
    return torch.autograd.grad(entering, values, grad_outputs=inward, allow_unused=True)


def _checked_metric(value: Any, batch: int) -> torch.Tensor:
    """``metric``'s value, refused unless it is one number per prompt ``[batch]`` (or a scalar) with a gradient.

    A metric of another shape (``logits[:, -1, :5]``, every position's) would be summed into one number silently,
    and one that does not depend on the logits has no gradient to estimate with.
    """
    per_prompt = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == value.numel() == batch
    if not isinstance(value, torch.Tensor) or not (value.dim() == 0 or per_prompt):  # [batch] (or [batch, 1]), or ()
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise InvalidInput(
            f"metric returned {shape}: attribution patching estimates one number per prompt, so the metric must "
            f"map the logits [batch, seq, vocab] to [batch] = [{batch}] (or a scalar); reduce it, e.g. "
            "logits[:, -1, correct] - logits[:, -1, incorrect]"
        )
    if not value.requires_grad:
        raise GradientNotAvailable(
            "the metric's value does not depend on the logits it was given (it has no gradient), so attribution "
            "patching has nothing to estimate: compute it from the logits argument"
        )
    return value


def _corrupted_values(model: Any, prompts: list[str], order: list[tuple[int, str]]) -> dict:
    """The values of ``order`` on the corrupted run; the forward stops after the last (no logits computed).

    (A trace of its own rather than rows of the clean trace: in one batch the backward would run through
    the corrupted rows too, for gradients that are zero; measured 3% slower at 16 tokens, 19% at 69.)
    """
    saved: dict = {}
    with torch.no_grad(), model.trace(prompts) as tracer:
        for layer, name in order:
            saved[(layer, name)] = read(model, layer, name).save()
        tracer.stop()
    return saved


def _estimates(model: Any, prompts: list[str], patched: dict | None, order: list[tuple[int, str]],
               metric: Callable[[torch.Tensor], torch.Tensor], keep: dict[str, int]) -> dict:
    """``{(layer, value): estimate}`` on the clean run of ``prompts``: ``[batch, heads]`` for head outputs,
    ``[batch]`` for a contribution; ``patched``: the corrupted values (``None``: zero)."""
    estimates: dict = {}  # bound outside the trace, filled inside
    # No cache: a recurrent model that updates its cached state in place (RWKV) has no backward then.
    with torch.enable_grad(), no_weight_gradients(model), model.trace(prompts, use_cache=False, **keep):
        stream = model.layers[0].layer_input
        # The backward starts here: a leaf with the stream's data (the weights take no gradient).
        model.layers[0].layer_input = stream.detach().requires_grad_(True)
        values = [read(model, layer, name) for layer, name in order]
        head = _linear_head(model)
        if head is not None:
            entering, leaving = model.lm_head.input, model.lm_head.output
        logits = model.logits
        try:
            value = metric(logits)
        except IndexError as error:
            if not keep:
                raise
            raise InvalidInput(
                f"metric failed on the logits {tuple(logits.shape)} ({error}): with next_token_only=True the model "
                "computes the last position's logits only, so the metric sees [batch, 1, vocab]; read logits[:, -1], "
                "or leave next_token_only off"
            ) from error
        loss = _checked_metric(value, len(prompts)).sum()
        # One backward for the values asked only (the part of the graph below the earliest is not computed),
        # with no hook per value.
        if head is None:
            found = torch.autograd.grad(loss, values, allow_unused=True)
        else:
            found = _through_head(loss, values, entering, leaving, head.weight)
        for (layer, name), value, grad in zip(order, values, found, strict=True):
            if grad is None:
                raise GradientNotAvailable(f"the metric does not depend on layers[{layer}] {name}: no gradient "
                                           "reaches it, so attribution patching has no estimate for it")
            value = value.detach()
            delta = -value if patched is None else patched[(layer, name)] - value
            product = delta.float() * grad.float()
            # heads [b, s, H, head_dim] -> [b, H]; a contribution [b, s, d] (or [b, s, k·d] on k streams) -> [b]
            heads = name.endswith("head_outputs")
            estimates[(layer, name)] = (product.sum(dim=(1, -1)) if heads else product.flatten(1).sum(-1)).save()
    return estimates


def attribution_patching(
    model: Any,
    clean: str | Sequence[str],
    corrupted: str | Sequence[str] | None,
    metric: Callable[[torch.Tensor], torch.Tensor],
    over: str | Sequence[str] = OVER,
    next_token_only: bool = False,
) -> AttributionPatching:
    """The linear estimate of patching each head and sublayer of every layer from ``corrupted`` into ``clean``.

    For a value ``a`` (a head's output ``[b, s, head_dim]``, a sublayer's contribution ``[b, s, d]``),
    the estimate is ``Σ_positions,features (a_corrupted - a_clean) · ∂metric/∂a`` at the clean run: the
    first-order term of the change of ``metric`` when the corrupted value replaces the clean one at every
    position. Two forwards and one backward for every layer at once.

    Args:
        model: A `StandardizedTransformer`.
        clean: The prompt (or prompts) whose run is patched; the gradient is taken there.
        corrupted: The prompt (or prompts) the patched values come from, each of the same token length
            as its clean prompt; ``None``: zero (the estimate of zero-ablating each one).
        metric: The clean run's logits ``[batch, seq, vocab]`` to one number per prompt ``[batch]`` (or a
            scalar; any other shape is refused, `InvalidInput`, and one that does not depend on the logits
            is `GradientNotAvailable`): e.g. `logit_difference`, or
            ``lambda logits: logits[:, -1].softmax(-1)[:, token]``.
        over: Which of ``"heads"``, ``"attention"`` (the block's token mixer) and ``"mlp"`` to estimate (one
            of them alone may be given as a string).
        next_token_only: The model computes the last position's logits only (`nncanon.tools.next_token_only`),
            so ``metric`` sees ``[batch, 1, vocab]`` where the model takes ``logits_to_keep``: the same
            estimate for a metric of the next token (``logits[:, -1]``), without unembedding (forward and
            backward) the other positions. Default: every position's logits.

    Returns:
        An `AttributionPatching`: ``heads`` ``[layers, heads]``, ``attention`` and ``mlp`` ``[layers]``,
        with a leading batch axis when the prompts are a list (the estimate for each prompt).

    Example:
        >>> result = attribution_patching(model, "The Eiffel Tower is in the city of", None,
        ...                               lambda logits: logits[:, -1, paris])
        >>> result.heads      # [layers, heads]: the estimated change of the logit when each head is zeroed
    """
    if torch.is_inference_mode_enabled():
        raise GradientNotAvailable("attribution patching takes a backward, and torch.inference_mode() has none: "
                                   "call it outside the inference_mode block (torch.no_grad() is fine)")
    if isinstance(over, str):  # over="heads": one item, not its letters
        over = (over,)
    unknown = [item for item in over if item not in OVER]
    if unknown or not over:
        raise ValueError(f"over={tuple(over)!r}: choose among {OVER}")
    batch = prompt_list(clean)
    if corrupted is not None:
        check_pair(model, clean, corrupted, "attribution patching")
    plan = _plan(model, over)
    order = [(layer, name) for layer, chosen in plan.items()
             for name in in_execution_order(model, layer, list(chosen.values()))]
    if not order:
        raise none_serves(model, f"any of {tuple(over)}")
    keep = next_token_kwargs(model) if next_token_only else {}
    patched = _corrupted_values(model, prompt_list(corrupted), order) if corrupted is not None else None
    estimates = _estimates(model, batch, patched, order, metric, keep)
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
