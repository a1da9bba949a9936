"""The model-level values read at a module: the token and position embeddings and the final norm's output.

Each is a `nncanon.served.Binding` on the mounted model (``where`` is ``"model"``), served by the same `served`
descriptor as a block's values: a view of the model's tensor (a copy where the model changes it later, or broadcasts
one row over the batch), written back element by element, with its gradient. A family without the module declines the
value with the reason (`declines`): a rotary, ALiBi or recurrent model has no absolute position embeddings; a model
whose head reads the last block's output directly has no final norm.
"""

from __future__ import annotations

from typing import Any

from .families import Family
from .order import MODEL_ORDER
from .served import Binding, Site

#: The model-level values read at a module, in the order the model computes them.
MODEL_SITES = ("token_embeddings", "position_embeddings", "final_norm_output")


def final_norm_path(family: Family) -> str | None:
    """The module whose output is ``final_norm_output`` (`Family.final_norm`, else `Family.norm`)."""
    return family.final_norm or family.norm


def model_sites(model: Any, family: Family, config: Any) -> tuple[dict[str, Binding], dict[str, str]]:
    """The bindings of the model-level sites of mounted ``model``, and the reasons for those it has not."""
    bindings: dict[str, Binding] = {}
    declines: dict[str, str] = {}
    embeddings = family.embeddings
    token = Site(family.embed_tokens, clone=embeddings.in_place, leaf=True)
    bindings["token_embeddings"] = _binding("token_embeddings", model.get(family.embed_tokens), token, config)
    positions = model._optional(embeddings.positions)
    if positions is None:
        declines["position_embeddings"] = f"{config.model_type} has no absolute position embeddings: " + (
            embeddings.no_positions(config) if embeddings.positions is None else
            f"this configuration has no {embeddings.positions} module")
    else:
        site = Site(embeddings.positions, broadcast=True, leaf=True)
        bindings["position_embeddings"] = _binding("position_embeddings", positions, site, config)
    path = final_norm_path(family)
    if path == "lm_head":
        bindings["final_norm_output"] = _binding("final_norm_output", model.lm_head,
                                                 Site(family.lm_head, key="input"), config)
    elif (norm := model._optional(path)) is None:
        declines["final_norm_output"] = (
            f"this {config.model_type} configuration has no final norm: the head reads "
            + ("the last block's output" if not family.before_head else
               f"the last block's output through {', '.join(family.before_head)}")
            + " (a post-LN model norms each block's output inside the block)")
    else:
        bindings["final_norm_output"] = _binding("final_norm_output", norm, Site(path), config)
    return bindings, declines


def _binding(name: str, envoy: Any, site: Site, config: Any) -> Binding:
    order = f"this {config.model_type} model computes its values block by block, layers[0] first; {MODEL_ORDER}"
    return Binding(name, f"{envoy.path}.{site.key}", site, config, "model", order=order)
