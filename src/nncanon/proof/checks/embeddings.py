"""The model-level values read at a module: the token and position embeddings, the final norm's output.

- ``embeddings``: in one trace: each value equals its module's tensor read by a plain hook,
  bit for bit; ``layers[0].layer_input`` (its first stream, on a multi-stream model) is the family's formula of them,
  ``norm(project(token_embeddings) · scale + position_embeddings)`` (`nncanon.families.Embeddings`); the head of
  ``final_norm_output`` (the modules before it, the head, the logit post-processing) is ``logits``, and
  ``project_on_vocab``'s final norm of ``layers[-1].layer_output`` is ``final_norm_output``, both bit for bit. Then
  each value edited at the last position gives the logits a plain hook at its module making the same edit gives,
  bit for bit.
- ``embedding_gradients`` (`Check.gradient`): ``value.grad`` of each, inside ``with logit.backward():``, equals the
  gradient plain PyTorch computes at its module (``torch.autograd.grad``).

The ``invokes`` and ``locality`` checks (`writes`) cover them with the block values.
"""

from __future__ import annotations

from typing import Any

import torch

from ...model_sites import MODEL_SITES
from ...served import _pick, _put
from ..prompts import PROMPTS
from .base import GRADIENT_ABSOLUTE, GRADIENT_TOLERANCE, NO_CACHE, TOLERANCE, CheckResult, compare, guarded
from .gradient_references import gradient_inputs, gradient_target, gradients_at
from .references import encode


def served_sites(model: Any) -> list[str]:
    """The model-level values of `MODEL_SITES` ``model`` serves (not declined), in the order the model computes them."""
    declined = {**model.__dict__.get("_model_declines", {}), **model.__dict__.get("_model_absent", {})}
    return [name for name in MODEL_SITES if name not in declined]


def site_module(model: Any, name: str) -> torch.nn.Module:
    """The module of the unwrapped model at which the model-level value ``name`` is read."""
    return model._module.get_submodule(model._model_bindings[name].site.module)


def check_embeddings(model: Any) -> list[CheckResult]:
    """Each model-level value against a plain hook at its module; layers[0].layer_input == the family's formula of
    the embeddings; head(final_norm_output) == logits; project_on_vocab's final norm == final_norm_output; a write to
    each == the same edit by a plain hook at its module (the logits, bit for bit)."""
    names = served_sites(model)
    if not names:
        return []
    results = guarded("embeddings", None, names, lambda: _clean(model, names))
    for name in names:
        results += guarded("embeddings", None, (name,), lambda name=name: [_written(model, name)])
    return results


def _clean(model: Any, names: list[str]) -> list[CheckResult]:
    """The checks of one trace: the reads, the formula, the head, the lens's final norm."""
    saved: dict[str, Any] = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for name in names:
            if name != "final_norm_output":
                saved[name] = getattr(model, name).save()
        saved["entering"] = model.layers[0].layer_input.save()
        saved["leaving"] = model.layers[-1].layer_output.save()
        if "final_norm_output" in names:
            saved["final_norm_output"] = model.final_norm_output.save()
        saved["logits"] = model.logits.save()
    references = _references(model, names, encode(model))
    results = [compare("embeddings", None, (name,), saved[name], references[name].expand_as(saved[name]), 0.0,
                       "against a plain hook at its module") for name in names]
    if "token_embeddings" in saved:
        results.append(_formula(model, saved))
    if "final_norm_output" in saved:
        final = saved["final_norm_output"]
        with torch.no_grad():
            head = model._from_final_norm(final)
            lens = model._to_final_norm(saved["leaving"])
        results.append(compare("embeddings", None, ("final_norm_output",), head, saved["logits"], 0.0,
                               "the head of final_norm_output (with the logit post-processing) against the logits"))
        results.append(compare("embeddings", None, ("final_norm_output",), lens, final, 0.0,
                               "project_on_vocab's final norm of layers[-1].layer_output against final_norm_output"))
    return results


def _formula(model: Any, saved: dict) -> CheckResult:
    """``layers[0].layer_input`` (its first stream) against the family's formula of the embeddings."""
    embeddings = model.family.embeddings
    tokens, positions = saved["token_embeddings"], saved.get("position_embeddings")
    values = ("token_embeddings",) + (("position_embeddings",) if positions is not None else ())
    with torch.no_grad():
        if embeddings.combine is not None:
            expected = embeddings.combine(model._module, tokens, positions)
        else:
            expected = tokens
            if embeddings.project is not None and _optional(model, embeddings.project) is not None:
                expected = _optional(model, embeddings.project)(expected)
            scale = embeddings.scale and _factor(embeddings.scale, model._text_config)
            if scale is not None and scale != 1:
                expected = expected * scale
            if positions is not None:
                expected = expected + positions
            if embeddings.norm is not None:
                expected = model._module.get_submodule(embeddings.norm)(expected)
    entering = saved["entering"][..., : expected.shape[-1]]  # (a multi-stream model: the first stream)
    return compare("embeddings", None, values, entering, expected, TOLERANCE,
                   "layers[0].layer_input against the family's formula of the embeddings")


def _factor(attribute: Any, config: Any) -> Any:
    return attribute(config) if callable(attribute) else getattr(config, attribute, None)


def _optional(model: Any, path: str) -> torch.nn.Module | None:
    """The module at ``path`` of the unwrapped model, ``None`` where this configuration leaves it out."""
    parent, _, name = path.rpartition(".")
    return getattr(model._module.get_submodule(parent) if parent else model._module, name, None)


def _references(model: Any, names: list[str], inputs: dict) -> dict[str, torch.Tensor]:
    """Each value's tensor read by a plain hook at its module in one forward of the unwrapped model (the first
    call of the module; for the final norm, its last)."""
    found: dict[str, torch.Tensor] = {}

    def keep(raw: Any, name: str) -> None:
        if name == "final_norm_output" or name not in found:
            found[name] = _pick(raw, model._model_bindings[name].site).detach().clone()

    _forward(model, inputs, [_hook(model, name, lambda raw, name=name: keep(raw, name)) for name in names])
    return found


def _hook(model: Any, name: str, visit: Any) -> Any:
    """A plain hook at the module of the model-level value ``name``: ``visit(raw)`` with its output (or its
    ``(args, kwargs)``, for a value read at an input); what it returns, where not ``None``, replaces it."""
    module = site_module(model, name)
    if model._model_bindings[name].site.key == "input":
        return module.register_forward_pre_hook(lambda mod, args, kwargs: visit((args, kwargs)), with_kwargs=True)
    return module.register_forward_hook(lambda mod, args, out: visit(out))


def _forward(model: Any, inputs: dict, handles: list, graph: bool = False) -> Any:
    """The unwrapped model's logits on ``inputs`` with ``handles`` in place (removed after); with ``graph``, the
    forward tracks gradients and its output is returned whole."""
    try:
        if graph:
            with torch.enable_grad():
                return model._module(**inputs)
        with torch.no_grad():
            return model._module(**inputs).logits
    finally:
        for handle in handles:
            handle.remove()


def _edit(tensor: torch.Tensor) -> None:
    """The edit both sides make, in place, at the last position: ``x * 2 + 1``."""
    tensor[:, -1] = tensor[:, -1] * 2 + 1


def _written(model: Any, name: str) -> CheckResult:
    """The logits with ``name`` edited by its value and by a plain hook at its module making the same edit."""
    with torch.no_grad(), model.trace(PROMPTS[0]):
        _edit(getattr(model, name))
        ours = model.logits.save()
    site = model._model_bindings[name].site
    calls: list = []

    def edited(raw: Any) -> Any:
        calls.append(True)
        if name != "final_norm_output" and len(calls) > 1:
            return raw  # (the value is the module's first call; the final norm's, its last: one call in either case)
        tensor = _pick(raw, site).clone()
        _edit(tensor)
        return _put(raw, site, tensor)

    reference = _forward(model, encode(model), [_hook(model, name, edited)])
    return compare("embeddings", None, (name,), ours, reference, 0.0,
                   "edited at the last position, against a plain hook at its module making the same edit")


def check_embedding_gradients(model: Any) -> list[CheckResult]:
    """``value.grad`` of each model-level value, inside ``with logit.backward():``, equals the gradient of the same
    logit at its module by plain PyTorch (``torch.autograd.grad``)."""
    names = served_sites(model)
    if not names:
        return []
    return guarded("embedding_gradients", None, names, lambda: _gradients(model, names))


def _gradients(model: Any, names: list[str]) -> list[CheckResult]:
    target = gradient_target(model)
    values: dict[str, Any] = {}
    grads: dict[str, Any] = {}
    with torch.enable_grad(), model.trace(PROMPTS[0], **NO_CACHE):
        for name in names:
            values[name] = getattr(model, name)
        logit = model.logits[target]
        with logit.backward():
            for name in reversed(names):
                grads[name] = values[name].grad.save()
    edges: dict[str, Any] = {}

    def keep(raw: Any, name: str) -> Any:
        """The module's tensor, made a leaf where it is outside the graph (`ModelBinding.leaf`), its edge kept."""
        if name != "final_norm_output" and name in edges:
            return raw
        site = model._model_bindings[name].site
        tensor = _pick(raw, site)
        if not tensor.requires_grad:
            tensor = tensor.detach().requires_grad_(True)
            raw = _put(raw, site, tensor)
        edges[name] = torch.autograd.graph.get_gradient_edge(tensor)
        return raw

    handles = [_hook(model, name, lambda raw, name=name: keep(raw, name)) for name in names]
    with torch.enable_grad():
        output = _forward(model, gradient_inputs(model), handles, graph=True)
        kept = [name for name in names if name in edges]
        found = gradients_at(output, lambda logits: logits[target], [edges[name] for name in kept])
    expected = dict(zip(kept, found, strict=True))
    results = []
    for name in names:
        reference = expected.get(name)
        if reference is None:
            error = float(grads[name].abs().max())
            results.append(CheckResult("embedding_gradients", None, (name,), error == 0.0, error, 0.0,
                                       "the backward does not reach it in the plain model"))
            continue
        results.append(compare("embedding_gradients", None, (name,), grads[name], reference.expand_as(grads[name]),
                               GRADIENT_TOLERANCE, "against torch.autograd.grad at its module",
                               absolute=GRADIENT_ABSOLUTE))
    return results
