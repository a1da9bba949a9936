"""Routing.

- ``routing``: the chosen experts are distinct and valid; a router logit set to ``-inf`` takes that expert's output
  out of every token: it is no longer chosen, or (a router with a selection bias) chosen with weight 0; on a plain
  top-k router, the tokens not routed to it keep their experts.

Two kinds of router choose by more than each expert's own logit, and there only the first claim is a property of
the router (the second would hold on a twin by the luck of its small random biases, not on a trained checkpoint):

- a *selection bias* (DeepSeek-V3's ``e_score_correction_bias``, ERNIE-4.5's ``moe_statics``, AFMoE's and
  LFM2-MoE's ``expert_bias``) is added to the scores for the choice alone: a ``-inf`` logit scores the expert 0,
  its bias still counts, so it can keep its slot with weight 0; and where the scores are a softmax, masking one
  expert rescales the others' scores against their biases, so other tokens can move;
- *group-limited* routing (``n_group > topk_group``) first picks groups by their experts' scores: lowering one
  expert lowers its group's score, which can move tokens that never chose it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..prompts import PROMPTS
from .base import ROUTING, CheckResult, guarded
from .references import hf_block, served

#: Names of the tensors transformers' routers add to the scores for the choice alone.
SELECTION_BIASES = ("e_score_correction_bias", "expert_bias")


def check_routing(model: Any) -> list[CheckResult]:
    """The chosen experts are distinct and in range; a `-inf` logit takes the expert's output out of every token
    (a masked expert the router still chooses, as a selection bias can make it, weighs 0) and, on a plain top-k
    router, reroutes exactly its tokens."""
    results = []
    report = model.support()
    for index in report.layers_with("expert_indices"):
        names = tuple(name for name in ROUTING if report.available(name, layer=index))
        results += guarded("routing", index, names, lambda index=index, names=names: [
            _routing(model, index, names)])
    return results


def selection_biases(model: Any, layer: int) -> dict[str, torch.Tensor]:
    """The tensors block ``layer``'s router adds to its scores for the choice alone, by their names in the block."""
    block = hf_block(model, layer)
    return {name: tensor for name, tensor in [*block.named_buffers(), *block.named_parameters()]
            if name.rsplit(".", 1)[-1] in SELECTION_BIASES}


def choice_beyond_logits(model: Any, layer: int) -> str | None:
    """Why block ``layer``'s router chooses by more than each expert's own logit (a selection bias, group-limited
    routing), or ``None`` for a plain top-k router."""
    for name in selection_biases(model, layer):
        return f"a selection bias ({name})"
    config = model._module.config.get_text_config()
    groups, picked = getattr(config, "n_group", None) or 1, getattr(config, "topk_group", None)
    if groups > 1 and picked is not None and picked < groups and getattr(config, "topk_method", None) != "greedy":
        return f"group-limited routing ({picked} of {groups} groups)"
    return None


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
    detail = "distinct experts; masking one reroutes exactly its tokens"
    if "router_logits" in saved:
        logits = saved["router_logits"]
        if int(indices.max()) >= logits.shape[-1] or logits.shape[:2] != indices.shape[:2]:
            problems.append(f"router_logits {tuple(logits.shape)} do not index the experts {tuple(indices.shape)}")
        else:
            found, detail = _reroute(model, index, indices, [name for name in ordered if name != "router_logits"])
            problems += found
    return CheckResult("routing", index, names, not problems, None, None, "; ".join(problems) or detail)


def _reroute(model: Any, index: int, before: torch.Tensor, outputs: list[str]) -> tuple[list[str], str]:
    mlp = model.layers[index].mlp
    expert = int(before.flatten()[0])
    after = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        mlp.router_logits[..., expert] = float("-inf")
        for name in outputs:
            after[name] = getattr(mlp, name).save()
    beyond = choice_beyond_logits(model, index)
    kept = after["expert_indices"] == expert
    problems = []
    if kept.any() and beyond is None:
        problems.append(f"expert {expert} masked with -inf is still chosen")
    elif kept.any() and "expert_weights" not in after:
        problems.append(f"expert {expert} masked with -inf is still chosen ({beyond}), and no expert_weights "
                        "are served to show that it carries nothing")
    elif kept.any() and bool((after["expert_weights"][kept] != 0).any()):
        weight = float(after["expert_weights"][kept].abs().max())
        problems.append(f"expert {expert} masked with -inf is still chosen with weight up to {weight:.3g}")
    if beyond is not None and "expert_weights" in after and before.shape[-1] > 1:
        problems += _forced(model, index, before, outputs)  # (a twin's small biases rarely keep a masked expert)
    routed = (before == expert).any(-1)
    if beyond is None and not torch.equal(after["expert_indices"][~routed], before[~routed]):
        problems.append(f"masking expert {expert} moved tokens not routed to it")
    if beyond is None:
        return problems, "distinct experts; masking one reroutes exactly its tokens"
    return problems, (f"distinct experts; masking one takes its output out of every token ({beyond}: where the "
                      "router chooses a masked expert, as it must with all but top_k - 1 masked, it weighs 0; other "
                      "tokens' routing is not asserted)")


def _forced(model: Any, index: int, before: torch.Tensor, outputs: list[str]) -> list[str]:
    """Every expert masked but ``top_k - 1`` (the first token's first choices): the router must choose masked ones,
    and each must weigh exactly 0, whatever the router's biases or groups."""
    mlp = model.layers[index].mlp
    kept = before.flatten()[: before.shape[-1] - 1].tolist()
    after = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        logits = mlp.router_logits
        masked = torch.full_like(logits, float("-inf"))
        masked[..., kept] = logits[..., kept]
        mlp.router_logits = masked
        for name in outputs:
            after[name] = getattr(mlp, name).save()
    forced = ~torch.isin(after["expert_indices"], torch.tensor(kept, device=before.device))
    weights = after["expert_weights"]
    if not bool(forced.any()):
        return [f"with all but {len(kept)} experts masked, the router still chose no masked expert"]
    if bool(weights.isnan().any()) or bool((weights[forced] != 0).any()):
        worst = float(weights[forced].abs().nan_to_num(float("inf")).max())
        return [f"with all but {len(kept)} experts masked, a masked expert the router had to choose weighs "
                f"{worst:.3g}, not 0"]
    return []
