"""The model-level values read at a module: the token and position embeddings and the final norm's output.

Each is a `nncanon.served.Binding` on the mounted model (``where`` is ``"model"``), served by the same `served`
descriptor as a block's values: a view of the model's tensor (a copy where the model changes it later, or broadcasts
one row over the batch), written back element by element, with its gradient. A family without the module declines the
value with the reason (`declines`): a rotary, ALiBi or recurrent model has no absolute position embeddings; a model
whose head reads the last block's output directly has no final norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from .families import Family
from .order import MODEL_ORDER
from .served import Binding, Site, _pick, _put, _rows

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
    token = Site(family.embed_tokens, clone=embeddings.in_place)
    bindings["token_embeddings"] = _binding("token_embeddings", model.get(family.embed_tokens), token, config,
                                            leaf=True)
    positions = model._optional(embeddings.positions)
    if positions is None:
        declines["position_embeddings"] = f"{config.model_type} has no absolute position embeddings: " + (
            embeddings.no_positions(config) if embeddings.positions is None else
            f"this configuration has no {embeddings.positions} module")
    else:
        site = Site(embeddings.positions, clone=True)  # (a copy: the rows of one invoke, `ModelBinding.broadcast`)
        bindings["position_embeddings"] = _binding("position_embeddings", positions, site, config, leaf=True,
                                                   broadcast=True)
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


def _binding(name: str, envoy: Any, site: Site, config: Any, leaf: bool = False, broadcast: bool = False
             ) -> ModelBinding:
    order = f"this {config.model_type} model computes its values block by block, layers[0] first; {MODEL_ORDER}"
    return ModelBinding(name, f"{envoy.path}.{site.key}", site, config, "model", order=order, leaf=leaf,
                        broadcast=broadcast)


@dataclass
class ModelBinding(Binding):
    """A model-level site's binding: a `Binding` that may put its tensor into the autograd graph and serve a row the
    model broadcasts over the batch as each prompt's rows.

    Attributes:
        leaf: The tensor may be outside the autograd graph (XGLM's sinusoidal positions, an embedding whose weights
            take no gradient): in a trace that tracks gradients, the model is handed, at the read, a view of it made
            from a leaf that requires one (the same data, made then: the backward reaches it after the values the
            model computes later), so that the value's ``.grad`` is the gradient at it.
        broadcast: The tensor may hold one row the model broadcasts over the batch (GPT-2's position embeddings,
            from position ids ``[1, s]``): served as a copy with this invoke's rows, ``[b, s, d]``, written back as a
            tensor with every row of the batch, the other invokes' rows as the model's broadcast gives them (the site
            is a ``clone``: a write is always handed back).
    """

    leaf: bool = False
    broadcast: bool = False

    def read(self, raw: Any, mediator: Mediator) -> torch.Tensor:
        """What the user reads: the tensor (in the graph, where `leaf`), with this invoke's rows (`broadcast`)."""
        tensor = _pick(raw, self.site)
        if self.leaf and torch.is_grad_enabled() and tensor.is_floating_point() and not tensor.requires_grad:
            Mediator.swap(self.location, _put(raw, self.site, tensor.detach().requires_grad_(True).view_as(tensor)))
            raw = Mediator.value(self.location)  # (the model's value now: the view, in this invoke's rows)
        if not self.broadcast:
            return super().read(raw, mediator)
        tensor = _pick(raw, self.site)
        if tensor.shape[0] == 1:
            total, rows = _rows(mediator)
            tensor = tensor.expand(rows[1] if rows is not None else max(total, 1), *tensor.shape[1:])
        return tensor.clone()

    def _in_layout(self, value: torch.Tensor, tensor: torch.Tensor, mediator: Mediator | None) -> torch.Tensor:
        """``value`` as the model's ``tensor``; a `broadcast` row widened to the whole batch, the other invokes' rows
        the model's own row."""
        total, rows = _rows(mediator) if mediator is not None else (0, None)
        if not self.broadcast or value.shape[0] == tensor.shape[0] or rows is None:
            return super()._in_layout(value, tensor, mediator)
        start, size = rows
        before = tensor.expand(start, *tensor.shape[1:])
        after = tensor.expand(total - start - size, *tensor.shape[1:])
        return torch.cat([before, value, after], dim=0)
