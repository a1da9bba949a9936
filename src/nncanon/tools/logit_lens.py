"""The logit lens: every layer's residual stream read through the model's own head, in one forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidInput
from ..inputs import prompt_list
from ._common import Positions, index_positions, layer_list


def logit_lens(
    model: Any,
    prompts: str | Sequence[str],
    layers: int | Sequence[int] | None = None,
    positions: Positions = None,
) -> torch.Tensor:
    """The logits each layer's output would give: ``project_on_vocab(layers[l].layer_output)``.

    One forward for the whole batch. ``project_on_vocab`` is the family's own final norm, head and
    logit post-processing, so at the last layer the lens *is* the model's ``logits`` (bit for bit).

    Args:
        model: A `StandardizedTransformer`.
        prompts: One prompt or a list (left-padded in one batch, so position ``-1`` is every
            prompt's last token).
        layers: The layers to read (default: all), in the output's order.
        positions: Positions of the padded batch to project (default: all). An int drops the axis.

    Returns:
        Logits ``[batch, len(layers), seq, vocab]`` (``[batch, len(layers), vocab]`` for an int
        position), on the model's device.

    Example:
        >>> lens = logit_lens(model, ["The Eiffel Tower is in the city of"], positions=-1)
        >>> lens.softmax(-1).argmax(-1)          # [1, num_layers]: the top token by layer
    """
    indices = layer_list(model, layers)
    if not indices:
        raise InvalidInput(f"layers={layers!r} names no layer: give a layer, a list of layers, or None for all")
    rows: list[torch.Tensor] = []  # bound outside the trace, appended inside
    with torch.no_grad(), model.trace(prompt_list(prompts)):
        for index in sorted(set(indices)):
            hidden = index_positions(model.layers[index].layer_output, positions)
            rows.append(model.project_on_vocab(hidden).save())
    by_layer = dict(zip(sorted(set(indices)), rows, strict=True))
    return torch.stack([by_layer[index] for index in indices], dim=1)


def lens_top_tokens(model: Any, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The top token of every lens row: ``(ids, probabilities, strings)``, same leading shape as ``lens[..., 0]``."""
    probs = lens.float().softmax(-1)
    top, ids = probs.max(-1)
    flat = model.tokenizer.convert_ids_to_tokens(ids.flatten().tolist())
    strings = [model.tokenizer.convert_tokens_to_string([token]) for token in flat]
    return ids, top, _reshape(strings, list(ids.shape))


def _reshape(items: list, shape: list[int]) -> list:
    if len(shape) <= 1:
        return items
    step = len(items) // shape[0]
    return [_reshape(items[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def plot_logit_lens(
    model: Any,
    prompt: str,
    layers: int | Sequence[int] | None = None,
    path: str | None = None,
    title: str | None = None,
) -> Any:
    """A heatmap of the logit lens of one prompt: the top token and its probability, by layer and position.

    Rows are layers (first at the bottom), columns the prompt's tokens; each cell shows the
    lens's top next-token prediction there, coloured by its probability. Needs matplotlib
    (``pip install "nncanon[plot]"``).

    Args:
        model: A `StandardizedTransformer`.
        prompt: One prompt.
        layers: The layers to show (default: all).
        path: Where to write the figure as PNG (default: not written).
        title: The figure's title (default: the prompt).

    Returns:
        The ``matplotlib.figure.Figure``.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError('plot_logit_lens needs matplotlib: pip install "nncanon[plot]"') from error

    indices = layer_list(model, layers)
    lens = logit_lens(model, prompt, layers=indices)[0]  # [layers, seq, vocab]
    _, top, strings = lens_top_tokens(model, lens)
    top = top.cpu().numpy()
    input_ids = model.tokenizer(prompt, return_tensors="pt")["input_ids"][0].tolist()
    inputs = [model.tokenizer.convert_tokens_to_string([t]) for t in model.tokenizer.convert_ids_to_tokens(input_ids)]

    rows, columns = top.shape
    figure = Figure(figsize=(max(4.0, 0.9 * columns + 2.0), max(3.0, 0.45 * rows + 1.5)))
    axes = figure.add_subplot()
    image = axes.imshow(top, origin="lower", aspect="auto", cmap="Blues", vmin=0.0, vmax=1.0)
    for row in range(rows):
        for column in range(columns):
            text = strings[row][column].replace("\n", "\\n")
            axes.text(column, row, text[:8], ha="center", va="center", fontsize=7,
                      color="white" if top[row, column] > 0.6 else "black")
    axes.set_xticks(range(columns), [repr(t)[1:-1][:10] for t in inputs], rotation=60, ha="right", fontsize=7)
    axes.set_yticks(range(rows), [str(i) for i in indices], fontsize=7)
    axes.set_xlabel("input token (position)")
    axes.set_ylabel("layer")
    axes.set_title(title if title is not None else prompt, fontsize=9)
    figure.colorbar(image, ax=axes, label="probability of the top token")
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, format="png", dpi=120)
    return figure
