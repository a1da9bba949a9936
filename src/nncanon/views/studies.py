"""The studies view: ``nncanon ablate``'s layer x head heatmaps (exact ablation or the ``--fast`` estimate, written
on each heatmap), models side by side, and its ablation table (P(target) clean and with each part zeroed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import InvalidInput
from ..study import color_limits, layer_labels
from .page import Page, render, rounded


def study_data(effects: Mapping[str, torch.Tensor], target: str, prompt: str | None = None,
               estimated: str | None = None, linear_layers: Mapping[str, set[int]] | None = None,
               shared_scale: bool = False, studies: Mapping[str, Mapping[str, float]] | None = None) -> dict:
    """The page's data: per model its ``grid`` ``[layers][heads]`` (``None`` where a layer has no such head), row
    ``labels``, colour ``limit``, and what the numbers are (``kind``: ``"exact"`` or ``"estimated"``, ``quantity``).

    Raises:
        InvalidInput: a grid that is not ``[layers, heads]``.
    """
    linear_layers = linear_layers or {}
    limits = color_limits(dict(effects), shared_scale)
    quantity = (f"estimated drop in the log-odds of P({target.strip()})" if estimated == "log_odds" else
                f"estimated drop in P({target.strip()})" if estimated else f"drop in P({target.strip()})")
    models = []
    for name, grid in effects.items():
        grid = torch.as_tensor(grid, dtype=torch.float32)
        if grid.dim() != 2:
            raise InvalidInput(f"the effects of {name!r} are {list(grid.shape)}: give [layers, heads] (head_effects)")
        models.append({"name": name, "limit": rounded(limits[name]),
                       "labels": layer_labels(grid.shape[0], set(linear_layers.get(name, set()))),
                       "grid": [[rounded(v) for v in row] for row in grid.tolist()]})
    table = {label: {run: rounded(p) for run, p in study.items()} for label, study in (studies or {}).items()}
    return {"models": models, "target": target, "prompt": prompt, "kind": "estimated" if estimated else "exact",
            "quantity": quantity, "shared_scale": shared_scale, "studies": table}


def study_page(effects: Mapping[str, torch.Tensor], target: str, prompt: str | None = None,
               estimated: str | None = None, linear_layers: Mapping[str, set[int]] | None = None,
               shared_scale: bool = False, studies: Mapping[str, Mapping[str, float]] | None = None,
               title: str | None = None) -> Page:
    """The page of ``effects`` (``{model: [layers, heads]}`` from `nncanon.study.head_effects`; ``estimated``: the
    ``--fast`` metric, as `plot_head_effects` takes it) and, optionally, ``studies`` (`ablation_study`'s tables)."""
    data = study_data(effects, target, prompt, estimated, linear_layers, shared_scale, studies)
    notes: list[Any] = []
    if not data["models"]:
        notes.append("No model's effects were given: there is no heatmap to draw.")
    name = title if title is not None else (f"Head ablation study: {prompt!r} -> {target!r}" if prompt
                                            else f"Head ablation study -> {target!r}")
    return render("study", name, data, notes)
