"""The ablation study of the docs' ablation page, as functions: what ``nncanon ablate`` runs.

`ablation_study` zeroes, in one batched trace, block ``layer``'s token mixer, its MLP and each of its
heads, and skips the block in a trace of its own; `head_effects` measures every head of every layer.
Both read P(target) at the last position, and both work on every family: on a hybrid block the
mixer is the linear-attention / state-space mixer (``linear_attn``) and its heads are its own.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import InvalidArgument
from .reading import head_count
from .resuming import next_token_only
from .tools.ablation import head_ablation_sweep
from .tools.attribution_patching import attribution_patching

#: (component, contribution value, head value) of the two kinds of token mixer.
MIXERS = (
    ("self_attn", "attention_output", "attention_head_outputs"),
    ("linear_attn", "linear_attention_output", "linear_attention_head_outputs"),
)


def target_token(model: Any, target: str) -> int:
    """The first token of ``target`` (e.g. ``" Paris"``)."""
    ids = model.tokenizer(target, add_special_tokens=False).input_ids
    if not ids:
        raise ValueError(f"target {target!r} encodes to no token")
    return ids[0]


def target_notes(model: Any, target: str) -> list[str]:
    """What a user should know about the token `target_token` scores for ``target`` (empty: nothing).

    ``"Paris"`` without its leading space is usually another token than the word after a space
    (``" Paris"``), and a target of several tokens is scored by its first only.
    """
    tokenizer = model.tokenizer
    ids = tokenizer(target, add_special_tokens=False).input_ids
    if not ids:
        return []
    shown = tokenizer.convert_ids_to_tokens(ids[0])
    notes = []
    if not target.startswith(" "):
        spaced = tokenizer(" " + target, add_special_tokens=False).input_ids
        if spaced and spaced[0] != ids[0]:
            notes.append(
                f"the target {target!r} has no leading space: its first token is {shown!r} (id {ids[0]}), a different "
                f"token from the first of {' ' + target!r}, {tokenizer.convert_ids_to_tokens(spaced[0])!r} "
                f"(id {spaced[0]}); scoring {shown!r}. Pass --target {' ' + target!r} for the word after a space."
            )
    if len(ids) > 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        notes.append(f"the target {target!r} is {len(ids)} tokens {pieces}: P(target) is the probability of the "
                     f"first, {shown!r} (id {ids[0]})")
    return notes


def mixer_of(model: Any, layer: int) -> tuple[str, str, str | None]:
    """Block ``layer``'s token mixer: (component, contribution value, head value or ``None``)."""
    report = model.support()
    for component, contribution, heads in MIXERS:
        if report.available(contribution, layer=layer):
            return component, contribution, heads if report.available(heads, layer=layer) else None
    raise ValueError(f"layers[{layer}] serves no token-mixer contribution: {report.reason('attention_output', layer)}")


def ablation_study(model: Any, prompt: str, target: str, layer: int) -> dict[str, float]:
    """P(target) clean, with block ``layer``'s mixer, MLP or each head zeroed, and with blocks skipped.

    The clean and zeroed runs are invokes of one trace; the skip (blocks ``layer`` and ``layer + 1``,
    or ``layer`` alone if it is the last) is a trace of its own, since a skip covers every row.
    Returns ``{run name: probability}`` in the order of the ablation page.
    """
    token = target_token(model, target)
    component, contribution, head_value = mixer_of(model, layer)
    mixer_name = "attention" if component == "self_attn" else "linear mixer"
    has_mlp = model.support().available("mlp_output", layer=layer)
    block = model.layers[layer]
    heads = head_count(model, layer, head_value) if head_value else 0
    probabilities: dict[str, Any] = {}
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(prompt):
            probabilities["clean"] = model.next_token_probs[0, token].save()
        with tracer.invoke(prompt):
            getattr(getattr(block, component), contribution)[:] = 0
            probabilities[mixer_name] = model.next_token_probs[0, token].save()
        if has_mlp:
            with tracer.invoke(prompt):
                block.mlp.mlp_output[:] = 0
                probabilities["mlp"] = model.next_token_probs[0, token].save()
        for head in range(heads):
            with tracer.invoke(prompt):
                getattr(getattr(block, component), head_value)[..., head, :] = 0
                probabilities[f"head {head}"] = model.next_token_probs[0, token].save()
    end = min(layer + 1, model.num_layers - 1)
    skipped = f"blocks {layer}-{end}" if end > layer else f"block {layer}"
    with torch.no_grad(), model.trace(prompt):
        model.skip_layers(layer, end)
        probabilities[skipped] = model.next_token_probs[0, token].save()
    return {name: float(p) for name, p in probabilities.items()}


#: What ``head_effects(fast=True)`` estimates by default: the drop in the target's log-odds,
#: ``logit[target] - logsumexp(logits of the others)``, a logit difference that does not saturate where P(target) is
#: near 1 (P's gradient, ``P·(1-P)·...``, vanishes there and ranks small effects by noise).
FAST_METRICS = ("log_odds", "probability")


def head_effects(model: Any, prompt: str, target: str, fast: bool = False, metric: str = "log_odds") -> torch.Tensor:
    """``[num_layers, max_heads]``: P(target) clean minus P(target) with that head zeroed.

    `head_ablation_sweep` per kind of head (attention, a hybrid's linear mixer): one invoke per
    head, the blocks before each layer run once. Layers without per-head values, and heads past a
    layer's count, are NaN. ``fast``: the first-order estimate instead (`attribution_patching` with
    no corrupted prompt: two forwards and one backward for every head), which can rank heads
    differently from the exact effect (see the benchmarks page), of the drop in ``metric``: ``"log_odds"``
    (default: the target's logit minus the logsumexp of the others', which does not saturate near P = 1) or
    ``"probability"`` (P(target), the exact sweep's scale).
    """
    token = target_token(model, target)
    if fast:
        if metric not in FAST_METRICS:
            raise InvalidArgument(f"metric={metric!r} is not one of {', '.join(FAST_METRICS)}")

        def probability(logits: torch.Tensor) -> torch.Tensor:
            return torch.softmax(logits[:, -1].float(), -1)[:, token]

        def log_odds(logits: torch.Tensor) -> torch.Tensor:
            last = logits[:, -1].float()
            others = torch.cat([last[:, :token], last[:, token + 1:]], dim=-1)
            return last[:, token] - torch.logsumexp(others, dim=-1)

        chosen = log_odds if metric == "log_odds" else probability
        return -attribution_patching(model, prompt, None, chosen, over=("heads",), next_token_only=True).heads
    with torch.no_grad(), model.trace(prompt, **next_token_only(model)):
        clean = model.next_token_probs[0, token].save()
    report = model.support()
    grids: dict[int, torch.Tensor] = {}
    for _, _, head_value in MIXERS:  # a block with both mixers (Falcon-H1) shows its attention heads
        layers = [layer for layer in report.layers_with(head_value) if layer not in grids]
        if layers:
            probabilities = head_ablation_sweep(
                model, prompt, layers, head_value, metric=lambda logits: torch.softmax(logits, -1)[:, token]
            )
            grids.update(zip(layers, float(clean) - probabilities, strict=True))
    width = max((len(row) for row in grids.values()), default=0)
    out = torch.full((model.num_layers, width), float("nan"))
    for layer, row in grids.items():
        out[layer, : len(row)] = row
    return out


def strongest_layer(effects: torch.Tensor) -> int:
    """The layer holding the head whose ablation moves P(target) most (from `head_effects`)."""
    magnitude = torch.nan_to_num(effects.abs(), nan=-1.0).amax(dim=1)
    return int(magnitude.argmax())


def linear_head_layers(model: Any) -> set[int]:
    """The layers whose row in `head_effects` holds a linear mixer's heads (not softmax attention heads)."""
    report = model.support()
    attention = set(report.layers_with(MIXERS[0][2]))
    return set(report.layers_with(MIXERS[1][2])) - attention


def color_limits(effects: dict[str, torch.Tensor], shared_scale: bool = False) -> dict[str, float]:
    """Each heatmap's colour limit: its own largest ``|effect|``, or the largest of all with ``shared_scale``."""
    own = {name: float(torch.nan_to_num(grid.abs(), nan=0.0).max()) or 1.0 for name, grid in effects.items()}
    if shared_scale:
        top = max(own.values(), default=1.0)
        return dict.fromkeys(own, top)
    return own


def layer_labels(num_layers: int, linear_layers: set[int]) -> list[str]:
    """The heatmap's row labels: the layer number, ``"3 (linear)"`` where the heads are a linear mixer's."""
    return [f"{layer} (linear)" if layer in linear_layers else str(layer) for layer in range(num_layers)]


def plot_head_effects(
    effects: dict[str, torch.Tensor],
    target: str,
    path: str,
    prompt: str | None = None,
    shared_scale: bool = False,
    linear_layers: dict[str, set[int]] | None = None,
    estimated: str | None = None,
) -> str:
    """Save one heatmap per model (layers x heads, effect on P(target)) side by side as a PNG.

    Args:
        effects: ``{model name: [num_layers, max_heads]}`` from `head_effects`.
        target: The target, for the titles.
        path: Where to write the PNG.
        prompt: Shown above the heatmaps.
        shared_scale: One colour scale for every model (compare models), instead of one each.
        linear_layers: ``{model name: layers}`` whose heads are a linear mixer's (`linear_head_layers`):
            their rows are labelled ``(linear)`` and drawn hatched, apart from softmax attention heads.
        estimated: For `head_effects` ``fast=True``: the metric estimated (``"log_odds"``, ``"probability"``); the
            titles then say "estimated" and what of, so that an estimate never reads as an exact effect.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    limits = color_limits(effects, shared_scale)
    linear_layers = linear_layers or {}
    figure, axes = plt.subplots(1, len(effects), figsize=(4.5 * len(effects), 4.2), squeeze=False)
    for axis, (name, grid) in zip(axes[0], effects.items(), strict=True):
        limit = limits[name]
        image = axis.imshow(grid.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
        quantity = f"log-odds of P({target.strip()})" if estimated == "log_odds" else f"P({target.strip()})"
        axis.set_title(f"{name}: {'estimated ' if estimated else ''}drop in {quantity}")
        axis.set_xlabel("head")
        axis.set_ylabel("layer")
        axis.set_xticks(range(grid.shape[1]))
        axis.set_yticks(range(grid.shape[0]), layer_labels(grid.shape[0], linear_layers.get(name, set())))
        for layer in sorted(linear_layers.get(name, set())):
            axis.add_patch(Rectangle((-0.5, layer - 0.5), grid.shape[1], 1, fill=False, hatch="//", linewidth=0,
                                   edgecolor="0.6", alpha=0.6))
        figure.colorbar(image, ax=axis, fraction=0.046)
    if prompt is not None:
        scale = "one colour scale for all" if shared_scale else "one colour scale per model"
        kind = "; ESTIMATED: attribution patching, first order, not the exact effect" if estimated else ""
        figure.suptitle(f"prompt {prompt!r} ({scale}; hatched rows: linear-mixer heads{kind})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
