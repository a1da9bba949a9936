"""Tools on a dictionary's features: ablate and steer them, attribute a metric to them, find what they fire on.

- `ablate_features` and `steer_features` (inside a trace): set features to a value, or add to them, at chosen
  positions; the splice carries the edit into the model (``decode(edited) - decode(features)`` added to the value).
- `feature_attribution`: the first-order estimate of zero-ablating every feature at once, ``-f · ∂metric/∂f``
  summed over positions, from one forward and one backward (as `nncanon.tools.attribution_patching` estimates
  heads and sublayers).
- `top_activating_contexts`: over a list of texts, the tokens where each feature is largest, with their context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import GradientNotAvailable, InvalidArgument, InvalidInput
from ..gradients import no_weight_gradients
from ..inputs import prompt_list
from ..tools._common import Positions, check_indices, checked_positions, finite
from .splice import NO_GRADIENT, AttachedDictionary, execution_rank


def _feature_index(attached: AttachedDictionary, features: int | Sequence[int] | torch.Tensor) -> list[int]:
    listed = [int(features)] if isinstance(features, int) or (
        isinstance(features, torch.Tensor) and features.dim() == 0) else [int(f) for f in features]
    size = attached.dictionary.d_sae
    check_indices(listed, size, "features", f"{attached.name} has {size} features")
    return [f % size for f in listed]


def positive(tool: str, name: str, value: Any) -> int:
    """``value`` where it is a positive int; else `InvalidArgument` naming the tool and the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{tool}: {name}={value!r}; it is a positive int")
    return value


def _amount(tool: str, name: str, value: Any) -> None:
    """A number or tensor to write into features: finite, as `nncanon.tools.steer` refuses it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise InvalidInput(f"{tool}'s {name} is a {type(value).__name__}: give a number (or a tensor that broadcasts "
                           "to the features written)")
    finite(tool, name, value)


def progress_bar(total: int, what: str, progress: bool | None, batch_size: int) -> Any:
    """A tqdm bar over ``total`` texts (``progress`` ``None``: where there is more than one batch), or ``None``."""
    if progress is None:
        progress = total > batch_size
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="text", desc=what)


def _select(values: torch.Tensor, positions: Positions) -> Any:
    return slice(None) if positions is None else checked_positions(positions, values.shape[1])


def ablate_features(attached: AttachedDictionary, features: int | Sequence[int] | torch.Tensor,
                    positions: Positions = None, value: float = 0.0) -> None:
    """Inside a trace: set ``features`` of ``attached`` to ``value`` (default 0) at ``positions`` (default all).

    The value at the dictionary's point moves by exactly ``decode(ablated) - decode(features)``; everything the
    dictionary does not reconstruct (the error term) stays. Touches the calling invoke's rows only.
    """
    _amount("ablate_features", "value", value)
    index = _feature_index(attached, features)
    current = attached.features
    current[:, _select(current, positions), index] = value


def steer_features(attached: AttachedDictionary, features: int | Sequence[int] | torch.Tensor, amount: float,
                   positions: Positions = None) -> None:
    """Inside a trace: add ``amount`` to ``features`` of ``attached`` at ``positions`` (default all): the value at
    the point moves by ``amount · W_dec[feature]`` (summed over the features given; scaled by the input
    normalisation where the dictionary has one)."""
    _amount("steer_features", "amount", amount)
    index = _feature_index(attached, features)
    current = attached.features
    current[:, _select(current, positions), index] += amount


def _checked_metric(value: Any, batch: int) -> torch.Tensor:
    per_prompt = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == value.numel() == batch
    if not isinstance(value, torch.Tensor) or not (value.dim() == 0 or per_prompt):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise InvalidInput(f"metric returned {shape}: feature attribution needs one number per prompt, [batch] = "
                           f"[{batch}] (or a scalar), e.g. logits[:, -1, correct] - logits[:, -1, incorrect]")
    if not value.requires_grad:
        raise GradientNotAvailable("the metric's value does not depend on the logits it was given (it has no "
                                   "gradient): compute it from the logits argument")
    return value


def feature_attribution(
    model: Any,
    attached: AttachedDictionary | Sequence[AttachedDictionary],
    prompts: str | Sequence[str],
    metric: Callable[[torch.Tensor], torch.Tensor],
    per_position: bool = False,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The estimated change of ``metric`` when each feature is zeroed: ``-Σ_positions f · ∂metric/∂f``.

    One forward with the dictionaries' features in the graph (the model's values are the clean run's: the splice
    adds ``(f - f_clean)·W_dec = 0``) and one backward for every feature of every dictionary given.

    Args:
        model: A `StandardizedTransformer` the dictionaries are attached to.
        attached: One `AttachedDictionary`, or several (then a dict by name).
        prompts: One prompt or a batch (left-padded).
        metric: The logits ``[batch, seq, vocab]`` to ``[batch]`` (or a scalar), e.g.
            ``lambda logits: logits[:, -1, paris]``.
        per_position: Keep the position axis: ``[batch, seq, d_sae]``.

    Returns:
        ``[d_sae]`` for one prompt, ``[batch, d_sae]`` for a list (``[.., seq, d_sae]`` with ``per_position``); a dict
        by attachment name when several were given.
    """
    if torch.is_inference_mode_enabled():
        raise GradientNotAvailable("feature attribution takes a backward, and torch.inference_mode() has none")
    items = [attached] if isinstance(attached, AttachedDictionary) else list(attached)
    if not items or not all(isinstance(item, AttachedDictionary) for item in items):
        raise InvalidInput("feature_attribution takes an attached dictionary (attach(model, dictionary)) or a "
                           "non-empty list of them")
    for item in items:
        item._refuse_detached("features")
        if not item.error_term:
            raise GradientNotAvailable(f"feature_attribution of {item.label}: {NO_GRADIENT}")
    batch = prompt_list(prompts)
    points = sorted(range(len(items)), key=lambda i: execution_rank(items[i].point_out))
    found: dict = {}
    with torch.enable_grad(), no_weight_gradients(model), model.trace(batch, use_cache=False):
        features = [items[i].features for i in points]
        value = _checked_metric(metric(model.logits), len(batch))
        grads = torch.autograd.grad(value.sum(), features, allow_unused=True)
        for i, feature, grad in zip(points, features, grads, strict=True):
            if grad is None:
                raise GradientNotAvailable(f"the metric does not depend on {items[i].label}: no gradient reaches it")
            effect = -(feature.detach() * grad)
            found[i] = (effect if per_position else effect.sum(dim=1)).save()
    results = {}
    for i, item in enumerate(items):
        result = found[i]
        results[item.name] = result[0] if isinstance(prompts, str) else result
    return results[items[0].name] if isinstance(attached, AttachedDictionary) else results


@dataclass
class TopContexts:
    """`top_activating_contexts`: per feature, the ``k`` tokens where it is largest, largest first.

    Attributes:
        features: The features, ``[F]``.
        values: ``[F, k]`` the activations (NaN where fewer than ``k`` tokens activated it at all).
        text: ``[F, k]`` which text (index into the texts given); -1 where empty.
        position: ``[F, k]`` the token's position in its text (0 = first token).
        tokens: The texts' tokens, as strings (``tokens[text][position]``).
    """

    features: torch.Tensor
    values: torch.Tensor
    text: torch.Tensor
    position: torch.Tensor
    tokens: list[list[str]]

    def contexts(self, feature: int, before: int = 24, after: int = 6) -> list[tuple[float, str]]:
        """``(activation, context)`` of ``feature``'s top tokens: ``before`` tokens, the token in ``[[...]]``, ``after``
        tokens (enough, by default, to tell the sentences apart: the start of a short text is all of it)."""
        row = int((self.features == feature).nonzero()[0, 0]) if (self.features == feature).any() else None
        if row is None:
            raise InvalidInput(f"feature {feature} was not asked for; these are {self.features.tolist()}")
        out = []
        for value, text, position in zip(self.values[row].tolist(), self.text[row].tolist(),
                                          self.position[row].tolist(), strict=True):
            if text < 0:
                continue
            tokens = self.tokens[text]
            left = "".join(tokens[max(0, position - before):position])
            right = "".join(tokens[position + 1:position + 1 + after])
            out.append((value, f"{left}[[{tokens[position]}]]{right}"))
        return out


def top_activating_contexts(
    model: Any,
    attached: AttachedDictionary,
    texts: Sequence[str],
    features: int | Sequence[int] | None = None,
    k: int = 10,
    batch_size: int = 8,
    progress: bool | None = None,
) -> TopContexts:
    """Over ``texts``, the ``k`` tokens where each of ``features`` (default: all) is largest.

    Runs the texts in batches of ``batch_size`` (no gradients), reads the features, and keeps a running top-``k``
    per feature: memory ``[F, k]`` plus one batch, whatever the number of texts. Padding is never counted.
    ``progress``: a progress bar over the texts (default: where there is more than one batch).
    """
    if isinstance(texts, str):
        raise InvalidInput("top_activating_contexts takes a list of texts, not one string: pass [text]")
    texts = list(texts)
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise InvalidInput("top_activating_contexts takes a non-empty list of non-empty texts")
    positive("top_activating_contexts", "k", k)
    positive("top_activating_contexts", "batch_size", batch_size)
    attached._refuse_detached("features")
    count = sum(len(ids) for ids in model.tokenizer(texts)["input_ids"])
    if k > count:
        raise InvalidArgument(f"top_activating_contexts: k={k}, but the texts hold {count} tokens in all: each feature "
                              f"can have at most {count} top tokens. Give k <= {count}, or more texts")
    chosen = list(range(attached.dictionary.d_sae)) if features is None else _feature_index(attached, features)
    index = torch.tensor(chosen)
    values = torch.full((len(chosen), k), float("-inf"))
    where = torch.full((len(chosen), k, 2), -1, dtype=torch.long)
    tokens: list[list[str]] = []
    bar = progress_bar(len(texts), "top activating contexts", progress, batch_size)
    for start in range(0, len(texts), batch_size):
        chunk = texts[start:start + batch_size]
        encoded = model.tokenizer(chunk, return_tensors="pt", padding=True)
        mask = encoded["attention_mask"].bool()
        if bar is not None:
            bar.update(len(chunk))
        saved: list = []
        with torch.no_grad(), model.trace(chunk):
            saved.append(attached.features[..., index.to(attached.dictionary.device)].save())
        acts = saved[0].float().cpu()  # [b, s, F]
        acts = acts.masked_fill(~mask[..., None], float("-inf"))
        lengths = mask.sum(-1)
        b, s, _ = acts.shape
        flat = acts.reshape(b * s, -1).T  # [F, b·s]
        top = min(k, flat.shape[1])
        best, positions = flat.topk(top, dim=1)
        rows = positions // s
        cols = positions % s - (s - lengths[rows])  # left padding: the token's position in its text
        candidates = torch.cat([values, best], dim=1)
        places = torch.cat([where, torch.stack([rows + start, cols], dim=-1)], dim=1)
        order = candidates.argsort(dim=1, descending=True)[:, :k]
        values = candidates.gather(1, order)
        where = places.gather(1, order[..., None].expand(-1, -1, 2))
        for row in range(len(chunk)):
            ids = encoded["input_ids"][row][mask[row]].tolist()
            tokens.append([model.tokenizer.decode([i]) for i in ids])
    if bar is not None:
        bar.close()
    empty = ~torch.isfinite(values) | (values <= 0)
    values = values.masked_fill(empty, float("nan"))
    where = where.masked_fill(empty[..., None], -1)
    return TopContexts(index, values, where[..., 0], where[..., 1], tokens)
