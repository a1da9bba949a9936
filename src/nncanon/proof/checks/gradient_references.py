"""The gradient references: the gradient of one logit at each value's site, by plain PyTorch (tensor hooks and
``torch.autograd.grad`` on the unwrapped model, or a plain copy for an operation's tensor), no weight gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...components.kernel import has_sinks, scores_operation
from ...reading import host
from ...served import _pick, _put, operation_name
from .base import GRADIENT_TOKEN, NO_CACHE
from .references import encode, finish, implementation_copy, plain_copy, site_module


def gradient_inputs(model: Any) -> dict:
    """The gradient checks' forward: `encode` without a cache (`NO_CACHE`)."""
    return {**encode(model), **NO_CACHE}


def gradient_target(model: Any) -> tuple[int, int, int]:
    """The logit the gradient checks differentiate: ``logits[0, -1, GRADIENT_TOKEN]`` as an index."""
    return (0, encode(model)["input_ids"].shape[1] - 1, GRADIENT_TOKEN)


def gradient_reference(model: Any, layer: int, names: Sequence[str], inputs: dict,
                       metric: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradient of ``metric(logits)`` (a scalar) with respect to each value of ``names`` on block
    ``layer``, by plain PyTorch (`gradient_references` of that one block)."""
    found = gradient_references(model, {layer: names}, inputs, metric)
    return {name: grad for (_, name), grad in found.items()}


def gradient_references(model: Any, names: dict[int, Sequence[str]], inputs: dict,
                        metric: Callable[[torch.Tensor], torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """The gradient of ``metric(logits)`` (a scalar) with respect to each value of ``names[layer]`` on each
    block ``layer``, by plain PyTorch, keyed ``(layer, name)``: a hook at each value's site registers a tensor
    hook on the model's own tensor, and ``torch.autograd.grad`` runs the backward. One forward and one
    backward for every module site (forward hooks) of every block; one each per operation site (nnsight's
    source hook on a plain ``NNsight`` over a copy of the model). Laid out as the value is served (token
    axis restored, heads split) and divided by the site's scale (``value = tensor · scale``). A value the
    backward does not reach has no entry.

    ``attention_probabilities`` is the tensor the model returns with ``output_attentions=True``; where the
    model does not run eager attention (the probabilities are recomputed beside the kernel), the tensor an
    eager copy of it (the same weights) returns.
    """
    grads: dict[tuple[int, str], torch.Tensor] = {}

    keep = _Kept(grads)

    sites = {(layer, name): host(model, layer, name)._nncanon.bindings[name].site
             for layer, listed in names.items() for name in listed if name not in _OWN_SITES}
    modules = {key: site for key, site in sites.items() if site.op is None and site.weighted is None}
    attentions = [layer for layer, listed in names.items() if "attention_probabilities" in listed]
    recomputed = [layer for layer in attentions if not model.layers[layer].self_attn._eager()]
    _module_gradients(model, modules, [layer for layer in attentions if layer not in recomputed], inputs,
                      metric, keep)
    if recomputed:  # probabilities recomputed beside the kernel (sdpa): eager's, on a copy with the same weights
        twin = implementation_copy(model, "eager")
        if twin is not None:
            _module_gradients(twin, {}, recomputed, inputs, metric, keep)
    inside = [(layer, name) for layer, listed in names.items() for name in listed
              if name == "attention_scores" or ((layer, name) in sites and sites[layer, name].op is not None
                                                and sites[layer, name].weighted is None)]
    if not _inside_gradients(model, inside, sites, inputs, metric, keep):  # (each alone where they cannot share)
        for layer, name in inside:
            if name == "attention_scores":
                _scores_gradient(model, layer, inputs, metric, keep)
            else:
                _operation_gradient(model, (layer, name), sites[layer, name], inputs, metric, keep)
    for key, site in sites.items():
        if site.weighted is not None:
            _weighted_gradient(model, key, site, inputs, metric, keep)
    finished = {}
    for (layer, name), grad in grads.items():
        if name == "attention_scores" and grad.dim() == 3:  # heads folded into the batch (XGLM): split out
            grad = grad.unflatten(0, (-1, host(model, layer, name)._nncanon.bindings["attention_head_outputs"].heads))
        binding = host(model, layer, name)._nncanon.bindings.get(name)
        finished[layer, name] = grad if binding is None else finish(grad, binding, inputs, divide=True)
    return finished


#: Values served by a property of their own, not at a site: their references are taken apart.
_OWN_SITES = ("attention_probabilities", "attention_scores")


def _inside_gradients(model: Any, keys: list[tuple[int, str]], sites: dict, inputs: dict, metric: Callable,
                      keep: _Kept) -> bool:
    """The gradients at the operation sites and scores of ``keys`` (in the forward's order) in one forward of a plain
    copy and one backward (as `_operation_gradient` and `_scores_gradient` take each); ``False`` where that raised
    (nothing kept: they are taken one by one)."""
    if len(keys) < 2:
        return False
    plain = plain_copy(model)
    read: dict = {}  # each operation's output or inputs, read once (the kernel call's inputs hold q, k and v)
    try:
        with torch.enable_grad():
            with plain.trace(**inputs):
                for layer, name in keys:
                    if name == "attention_scores":
                        attention = model.layers[layer].self_attn
                        spec = model.family.for_layer(model._text_config, layer)[0]
                        path = ".".join((model.family.layers, str(layer), spec.attention))
                        operation, listed = scores_operation(plain.get(path).source, attention._nncanon.probabilities,
                                                             has_sinks(attention._module))
                        keep((layer, name), operation.input[0] if listed else operation.input)
                        continue
                    site = sites[layer, name]
                    path = ".".join(part for part in (model.family.layers, str(layer), site.module) if part)
                    source = plain.get(path).source
                    op = operation_name(source.names, site.op)
                    if (path, op, site.key) not in read:
                        operation = getattr(source, op)
                        read[path, op, site.key] = operation.output if site.key == "output" else operation.inputs
                    keep((layer, name), _pick(read[path, op, site.key], site))
                output = plain.output.save()
            keep.backward(output, metric)
    except Exception:
        keep.edges = []
        return False
    return True


def _scores_gradient(model: Any, layer: int, inputs: dict, metric: Callable, keep: _Kept) -> None:
    """The gradient at block ``layer``'s scores (the eager softmax's input, `scores_operation`): one forward of a
    copy of the model as a plain ``NNsight``, a tensor hook on that input."""
    attention = model.layers[layer].self_attn
    plain = plain_copy(model)
    path = ".".join((model.family.layers, str(layer), model.family.for_layer(model._text_config, layer)[0].attention))
    with torch.enable_grad():
        with plain.trace(**inputs):
            operation, listed = scores_operation(plain.get(path).source, attention._nncanon.probabilities,
                                             has_sinks(attention._module))
            keep((layer, "attention_scores"), operation.input[0] if listed else operation.input)
            output = plain.output.save()
        keep.backward(output, metric)


class _Kept:
    """Keeps, for each tensor it is given, the edge of the autograd graph where the tensor is made at that moment
    (a tensor the model changes in place later, Falcon's MLP output, keeps its value there); `backward` asks the
    gradients of those edges alone (no weight's gradient is computed) and stores them by key."""

    def __init__(self, grads: dict) -> None:
        self.grads = grads
        self.edges: list[tuple[tuple[int, str], Any]] = []

    def __call__(self, key: tuple[int, str], tensor: torch.Tensor) -> None:
        if tensor.requires_grad:
            self.edges.append((key, torch.autograd.graph.get_gradient_edge(tensor)))

    def backward(self, output: Any, metric: Callable) -> None:
        """The gradients of ``metric(output.logits)`` at the edges kept since the last backward."""
        edges, self.edges = self.edges, []
        for (key, _), grad in zip(edges, gradients_at(output, metric, [edge for _, edge in edges]), strict=True):
            if grad is not None:
                self.grads[key] = grad


def gradients_at(output: Any, metric: Callable, inputs: Sequence[Any]) -> tuple:
    """``torch.autograd.grad`` of ``metric(output.logits)`` at ``inputs`` (tensors or gradient edges); ``None``
    for an input the metric does not reach."""
    target = metric(output.logits)
    if not inputs or not target.requires_grad:
        return (None,) * len(inputs)
    return torch.autograd.grad(target, list(inputs), allow_unused=True)


def _module_gradients(model: Any, sites: dict, attentions: list[int], inputs: dict, metric: Callable,
                      keep: _Kept) -> None:
    """One forward with a hook at each module site (and the probabilities of ``attentions`` returned), one
    backward."""
    handles = []
    for key, site in sites.items():
        module = site_module(model, *key)
        if site.key == "input" and site.private:  # the module is handed a copy of its own (`Site.private`)
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, kwargs, key=key, site=site: _kept_copy(keep, key, site, args, kwargs),
                with_kwargs=True))
        elif site.key == "input":
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, kwargs, key=key, site=site: keep(key, _pick((args, kwargs), site)),
                with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(
                lambda mod, args, output, key=key, site=site: keep(key, _pick(output, site))))
    try:
        with torch.enable_grad():
            output = model._module(**inputs, output_attentions=bool(attentions))
            for layer in attentions:
                keep((layer, "attention_probabilities"), _attentions_of(model, output.attentions, layer))
            keep.backward(output, metric)
    finally:
        for handle in handles:
            handle.remove()


def _kept_copy(keep: _Kept, key: tuple[int, str], site: Any, args: tuple, kwargs: dict) -> tuple:
    """The module's inputs with the site's tensor replaced by a copy, whose gradient edge is kept: the gradient of
    what this module reads alone (a tensor the block hands to other modules too has their gradients summed in)."""
    copy = _pick((args, kwargs), site).clone()
    keep(key, copy)
    return _put((args, kwargs), site, copy)


def _attentions_of(model: Any, attentions: Sequence[Any], layer: int) -> torch.Tensor:
    """Block ``layer``'s probabilities among those a model returns: one per block (MiniMax returns its
    linear blocks' weights too), or for each attention block (a hybrid's) in order, as many as it has
    attention sublayers (LongCat-Flash: two), the first being ``self_attn``'s."""
    if len(attentions) == model.num_layers and attentions[layer] is not None:
        return attentions[layer]
    report = model.support()
    present = [a for a in attentions if a is not None]
    blocks = [i for i in range(model.num_layers) if report.available("self_attn", layer=i)]
    each = len(present) // len(blocks)
    return present[blocks.index(layer) * each]


def _operation_gradient(model: Any, key: tuple[int, str], site: Any, inputs: dict, metric: Callable,
                        keep: _Kept) -> None:
    """One forward of a copy of the model as a plain ``NNsight``, a tensor hook on the operation's tensor."""
    plain = plain_copy(model)
    path = ".".join(part for part in (model.family.layers, str(key[0]), site.module) if part)
    with torch.enable_grad():
        with plain.trace(**inputs):
            source = plain.get(path).source
            operation = getattr(source, operation_name(source.names, site.op))
            keep(key, _pick(operation.output if site.key == "output" else operation.inputs, site))
            output = plain.output.save()
        keep.backward(output, metric)


def _weighted_gradient(model: Any, key: tuple[int, str], site: Any, inputs: dict, metric: Callable,
                       keep: _Kept) -> None:
    """The gradient at a ``weighted`` site's product, which no hook reaches: on a plain ``NNsight`` over a copy
    of the model, the product is made a tensor of its own (the weight's operation returns zeros, the product
    is added to the streams' operation, as the model's sum has it) and hooked."""
    plain = plain_copy(model)
    path = ".".join(part for part in (model.family.layers, str(key[0]), site.module) if part)
    weight_op, output_op = site.weighted
    with torch.enable_grad():
        with plain.trace(**inputs):
            source = plain.get(path).source
            weight = getattr(source, weight_op).output
            getattr(source, weight_op).output = torch.zeros_like(weight)
            product = weight * getattr(source, output_op).output
            keep(key, product)
            streams = getattr(source, site.op)
            streams.output = streams.output + product
            output = plain.output.save()
        keep.backward(output, metric)
