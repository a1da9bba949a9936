"""Routing.

- ``routing``: the chosen experts are distinct and valid; a router logit set to ``-inf`` removes that expert from
  exactly the tokens routed to it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..prompts import PROMPTS
from .base import ROUTING, CheckResult, guarded
from .references import served


def check_routing(model: Any) -> list[CheckResult]:
    """The chosen experts are distinct and in range; masking one expert reroutes exactly its tokens."""
    results = []
    report = model.support()
    for index in report.layers_with("expert_indices"):
        names = tuple(name for name in ROUTING if report.available(name, layer=index))
        results += guarded("routing", index, names, lambda index=index, names=names: [
            _routing(model, index, names)])
    return results


def _routing(model: Any, index: int, names: tuple[str, ...]) -> CheckResult:
    mlp = model.layers[index].mlp
    ordered = served(model, index, names)  # (asks the model: not inside the trace)
    saved = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for name in ordered:
            saved[name] = getattr(mlp, name).save()
    indices = saved["expert_indices"]
    problems = []
    if indices.dtype != torch.long:
        problems.append(f"expert_indices has dtype {indices.dtype}")
    flat = indices.reshape(-1, indices.shape[-1])
    if any(len(set(row.tolist())) != len(row) for row in flat):
        problems.append("a token has an expert twice")
    if "expert_weights" in saved and saved["expert_weights"].shape != indices.shape:
        problems.append(f"expert_weights {tuple(saved['expert_weights'].shape)} vs indices {tuple(indices.shape)}")
    if "router_logits" in saved:
        logits = saved["router_logits"]
        if int(indices.max()) >= logits.shape[-1] or logits.shape[:2] != indices.shape[:2]:
            problems.append(f"router_logits {tuple(logits.shape)} do not index the experts {tuple(indices.shape)}")
        else:
            problems += _reroute(model, index, indices)
    return CheckResult("routing", index, names, not problems, None, None,
                       "; ".join(problems) or "distinct experts; masking one reroutes exactly its tokens")


def _reroute(model: Any, index: int, before: torch.Tensor) -> list[str]:
    mlp = model.layers[index].mlp
    expert = int(before.flatten()[0])
    with torch.no_grad(), model.trace(PROMPTS[0]):
        mlp.router_logits[..., expert] = float("-inf")
        after = mlp.expert_indices.save()
    routed = (before == expert).any(-1)
    problems = []
    if (after == expert).any():
        problems.append(f"expert {expert} masked with -inf is still chosen")
    if not torch.equal(after[~routed], before[~routed]):
        problems.append(f"masking expert {expert} moved tokens not routed to it")
    return problems
