"""Numbers solved from the twin's tensors, named by the config attribute that holds them.

`solve_scales` finds the factors ``r`` with ``y - x = Σ r_i · c_i`` (least squares over a block's
candidate contributions); `config_attribute` names the config attribute whose value a factor is
(Granite's ``residual_multiplier``); `logit_steps` finds what the model does between ``lm_head`` and
its logits (soft-capping, scaling, truncating a padded vocabulary), by comparing the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..families.base import LogitStep

#: Relative error under which a solved factor is the config's number, and a fit is exact.
CLOSE = 1e-5


def solve_scales(x: torch.Tensor, y: torch.Tensor, parts: Sequence[torch.Tensor]) -> tuple[list[float], float]:
    """The factors ``r`` minimising ``|y - x - Σ r_i · parts_i|`` and the relative residual of the fit."""
    target = (y - x).double().flatten()
    columns = torch.stack([p.double().reshape(-1) for p in parts], dim=1)
    solution = torch.linalg.lstsq(columns, target.unsqueeze(1)).solution.squeeze(1)
    residual = (target - columns @ solution).norm() / max(float(target.norm()), 1e-30)
    return [float(v) for v in solution], float(residual)


def numbers_of(config: Any) -> dict[str, float]:
    """The config's numeric attributes (not booleans), by name."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def config_attribute(config: Any, value: float, exclude: Sequence[str] = ()) -> str | None:
    """The config attribute holding ``value`` (within `CLOSE`), preferring multipliers and scales."""
    matches = [name for name, number in numbers_of(config).items()
               if name not in exclude and abs(number - value) <= CLOSE * max(1.0, abs(value))]
    matches.sort(key=lambda name: (not any(w in name for w in ("multiplier", "scal", "factor")), name))
    return matches[0] if matches else None


def logit_steps(config: Any, head: torch.Tensor, logits: torch.Tensor) -> tuple[tuple[LogitStep, ...], str]:
    """The steps from ``lm_head``'s output ``head`` to ``logits``, and what was tried where none fits.

    Tried in order: nothing; truncation to ``logits``' width (a config attribute holding it); then
    dividing, multiplying or soft-capping by one config attribute. Returns ``((), reason)`` where none
    reproduces the logits to `CLOSE`.
    """
    steps: list[LogitStep] = []
    head = head.double()
    target = logits.double()
    if head.shape[-1] > target.shape[-1]:
        name = config_attribute(config, target.shape[-1])
        if name is None:
            return (), (f"the logits keep {target.shape[-1]} of lm_head's {head.shape[-1]} outputs; "
                        f"no config attribute holds {target.shape[-1]}")
        steps.append(LogitStep("truncate", name))
        head = head[..., : target.shape[-1]]
    if head.shape != target.shape:
        return (), f"lm_head returns {tuple(head.shape)}, the logits are {tuple(target.shape)}"

    def close(a: torch.Tensor) -> bool:
        return bool(((a - target).abs() <= CLOSE * (1 + target.abs())).all())

    if close(head):
        return tuple(steps), ""
    # Attributes named for the logits first (Granite's logits_scaling, not an attention_multiplier that
    # happens to be its inverse), then multipliers and scales.
    numbers = sorted(numbers_of(config).items(), key=lambda item: (
        "logit" not in item[0], not any(w in item[0] for w in ("multiplier", "scal", "cap")), item[0]))
    for name, number in numbers:
        if number == 0:
            continue
        for op, value in (("divide", head / number), ("multiply", head * number),
                          ("softcap", torch.tanh(head / number) * number)):
            if close(value):
                return (*steps, LogitStep(op, name)), ""
    ratio = float((target * head).sum() / (head * head).sum())
    return (), (
        f"the logits are not lm_head's output (after {', '.join(s.describe() for s in steps) or 'nothing'}): "
        f"tried dividing, multiplying and soft-capping by every numeric config attribute (a best scale would "
        f"be {ratio:.6g})"
    )
