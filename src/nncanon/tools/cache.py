"""The activation cache: every standard value of every layer from one forward."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..inputs import prompt_list
from ..reading import EXECUTION_ORDER, in_execution_order, read
from ._common import layer_list


class ActivationCache(Mapping):
    """Standard values by name, then by layer: ``cache["mlp_output"][3]`` is ``layers[3].mlp.mlp_output``.

    Only what a layer serves is cached (a name no layer serves is not a key);
    ``declined[(name, layer)]`` says why a value is missing (``model.support()``'s reason).
    ``logits`` holds the model's logits.
    """

    def __init__(self, values: dict[str, dict[int, torch.Tensor]], logits: torch.Tensor,
                 declined: dict[tuple[str, int], str]) -> None:
        self._values = values
        self.logits = logits
        self.declined = declined

    def __getitem__(self, name: str) -> dict[int, torch.Tensor]:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def stack(self, name: str) -> torch.Tensor:
        """``name`` of every cached layer stacked on a new first axis (layer order)."""
        by_layer = self._values[name]
        return torch.stack([by_layer[index] for index in sorted(by_layer)])

    def __repr__(self) -> str:
        rows = ", ".join(f"{name}: {sorted(layers)}" for name, layers in self._values.items())
        return f"ActivationCache({rows}; {len(self.declined)} declined)"


def cache_activations(
    model: Any,
    prompts: str | Sequence[str],
    values: str | Sequence[str] | None = None,
    layers: int | Sequence[int] | None = None,
) -> ActivationCache:
    """Every standard value of every layer (or those asked for), from one forward.

    Args:
        model: A `StandardizedTransformer`.
        prompts: One prompt or a batch (left-padded).
        values: A standard name, or the names, to keep (default: all of them, `EXECUTION_ORDER`: ``layer_input``, the
            attention's, a hybrid mixer's, the MLP's and a mixture of experts' values, ``layer_output``).
        layers: The layers (default: all).

    Returns:
        An `ActivationCache`; a value a layer declines (see ``model.support()``; e.g. the
        probabilities of DiffLlama, whose two softmaxes are not one head's pattern) is skipped and its reason kept in
        ``cache.declined``.
    """
    names = list(EXECUTION_ORDER) if values is None else [values] if isinstance(values, str) else list(values)
    for name in names:
        if name not in EXECUTION_ORDER:
            raise KeyError(f"{name!r} is not a standard layer value: {', '.join(EXECUTION_ORDER)}")
    ordered = [name for name in EXECUTION_ORDER if name in names]  # execution order within a block
    indices = sorted(set(layer_list(model, layers)))
    report = model.support()
    declined: dict[tuple[str, int], str] = {}
    plan: list[tuple[int, str]] = []
    for index in indices:
        served = []
        for name in ordered:
            reason = report.reason(name, layer=index)
            if reason is None:
                served.append(name)
            else:
                declined[(name, index)] = reason
        plan += [(index, name) for name in in_execution_order(model, index, served)]
    cached: dict[str, dict[int, torch.Tensor]] = {name: {} for name in ordered}
    logits: list[torch.Tensor] = []
    with torch.no_grad(), model.trace(prompt_list(prompts)):
        for index, name in plan:
            cached[name][index] = read(model, index, name).save()
        logits.append(model.logits.save())
    served = {name: by_layer for name, by_layer in cached.items() if by_layer}
    return ActivationCache(served, logits[0], declined)
