"""Every norm's scale and the stream it normalises before its weight (`nncanon.components.norms`).

- ``norms_run`` (first of all the checks): a plain forward with a hook on every served norm module; a norm module
  the forward never calls is dropped from the mounted model, with the reason, before any other check reads it.
- ``norms``: on every block serving them (and the final norm), one trace reads all the norm values while plain
  forward hooks read each norm module's input and output: ``centred input / scale · (offset + weight) (+ bias)``
  (the input read by the hook, the scale served) and ``normalized · (offset + weight) (+ bias)`` equal the norm's
  output;
  a norm before a sublayer is what the sublayer receives, a post-norm norms what the sublayer returns; a scale written
  (twice the clean scale at the last position) gives the logits a plain forward hook on the norm module gives when
  it replaces the output by the formula with that scale; and the frozen identity: every clean scale written back
  (each moved by one unit in the last place, so that the formula, not the norm, makes the output everywhere) leaves
  the logits as they were, within the bar.
- ``norm_gradients`` (`Check.gradient`): ``scale.grad`` and ``normalized.grad`` equal the gradients plain PyTorch
  computes with a forward hook making the norm's output the formula with a zero leaf added to the scale and one to
  the normalised value: the gradient at that leaf (one trace and one plain backward for every norm of the model).
"""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.util import first_input

from ...components.norms import FINAL_VALUES, NORM_VALUES, ROLES
from ...mounting import decline
from ...reading import host
from ..prompts import PROMPTS
from .base import (
    GRADIENT_ABSOLUTE,
    NO_CACHE,
    TOLERANCE,
    CheckResult,
    compare,
    guarded,
    scaled,
)
from .gradient_references import gradient_inputs, gradient_target, gradients_at
from .references import encode, hf_block, hooks_removed, served

#: The bar of the norm gradients, relative to each value's largest gradient (a scale's gradient is a sum over the
#: hidden width, rounded relative to its terms).
NORM_GRADIENT_BAR = 1e-4

#: The consumer of each pre-norm (the component whose input it is), and the component each post-norm norms.
_PRE = {"attention_norm": "self_attn", "linear_attention_norm": "linear_attn", "mlp_norm": "mlp"}
_POST = {"attention_post_norm": "self_attn", "linear_attention_post_norm": "linear_attn", "mlp_post_norm": "mlp"}


def _groups(model: Any, index: int | None, ordered: bool = True) -> list[tuple[Any, list[str]]]:
    """``(site, names)`` of each norm block ``index`` serves (``None``: the final norm), names in execution order
    (``ordered``; else as `ROLES` lists them, with no trace run to find the order)."""
    if index is None:
        names = [n for n in FINAL_VALUES if n not in model.__dict__.get("_model_declines", {})]
        found = model.__dict__.get("_final_norm")
        if isinstance(found, str) or found is None:
            return []
        bindings = {n: found[n] for n in names}
    else:
        if ordered:
            names = served(model, index, NORM_VALUES)
        else:
            report = model.support()
            names = [name for name in NORM_VALUES if report.available(name, layer=index)]
        bindings = {n: host(model, index, n)._nncanon.norms[n] for n in names}
    groups: dict[int, tuple[Any, list[str]]] = {}
    for name in names:
        site = bindings[name].site
        groups.setdefault(id(site), (site, []))[1].append(name)
    return list(groups.values())


def _read(model: Any, index: int | None, name: str) -> Any:
    return getattr(model if index is None else host(model, index, name), name)


def _role(model: Any, index: int, name: str) -> str:
    return next(role for role, (_, scale, normalized) in ROLES.items() if name in (scale, normalized))


def _reference(module: torch.nn.Module, anatomy: Any, x: torch.Tensor, scale: torch.Tensor | None = None,
               normalized: torch.Tensor | None = None) -> torch.Tensor:
    """The norm's output by its formula, written out here apart from the served code: input ``x``'s centred part over
    ``scale`` (``None``: its own), or ``normalized``, times ``offset + weight``, plus the bias, in ``x``'s dtype."""
    h = x.float()
    axes = tuple(range(-anatomy.dims, 0))
    if anatomy.kind == "layer":
        h = h - h.mean(dim=axes, keepdim=True)
    if normalized is None:
        own = torch.sqrt((h * h).mean(dim=axes, keepdim=True) + anatomy.eps)
        normalized = h / (own if scale is None else scale)
    out = normalized.float()
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if isinstance(weight, torch.Tensor):
        out = out * (weight.float() + anatomy.offset)
    elif anatomy.offset:
        out = out * anatomy.offset
    if isinstance(bias, torch.Tensor):
        out = out + bias.float()
    return out.to(x.dtype)


def _first_calls(modules: dict[str, torch.nn.Module]) -> tuple[dict, list]:
    """Forward hooks keeping each module's first input and output (by key): ``(seen, handles)``."""
    seen: dict = {}
    handles = []
    for key, module in modules.items():
        def hook(mod: Any, args: Any, kwargs: Any, out: Any, key: str = key) -> None:
            if key not in seen:
                seen[key] = (first_input(args, kwargs).detach().clone(),
                             (out[0] if isinstance(out, tuple) else out).detach().clone())
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return seen, handles


def _all_groups(model: Any, ordered: bool = True) -> dict[int | None, list]:
    """`_groups` of every block serving norm values, then the final norm's (key ``None``), in the forward's order."""
    found = {index: _groups(model, index, ordered) for index in [*range(model.num_layers), None]}
    return {index: groups for index, groups in found.items() if groups}


def check_norms_run(model: Any) -> list[CheckResult]:
    """Each served norm's module runs: one plain forward with a hook on every norm module. A norm the forward never
    calls (a block that builds a norm it does not use: it was taken for a role by its place in the source) is
    dropped from the mounted model before the other checks read the block's values, and fails here with the reason,
    so that it alone is declined. Runs first (`CHECKS`)."""
    every = _all_groups(model, ordered=False)
    modules = {(index, site.path): site.envoy._module for index, groups in every.items() for site, _ in groups}
    if not modules:
        return []
    seen, handles = _first_calls(modules)
    with hooks_removed(handles), torch.no_grad():
        model._module(**encode(model))
    results = []
    for index, groups in every.items():
        for site, names in groups:
            if (index, site.path) in seen:
                continue
            owner = "the model" if index is None else type(hf_block(model, index)).__name__
            reason = (f"its norm module {site.path} does not run: {owner}.forward builds it but never calls it on "
                      "this config")
            for name in names:
                if index is None:
                    model._model_declines[name] = reason
                else:
                    decline(model.layers[index], name, reason)
            results.append(CheckResult("norms_run", index, tuple(names), False, note=reason))
    return results


def check_norms(model: Any) -> list[CheckResult]:
    """Each norm's formula (centred / scale · weight + bias, and normalized · weight + bias) equals its output read by a
    plain hook; a pre-norm's output is its sublayer's input and a post-norm's input its sublayer's output; written
    scales equal a plain hook making the output the formula with them (the logits); writing back every clean scale
    (one ulp apart) leaves the logits within the bar. One trace reads every norm of the model; one trace of two
    invokes writes them back and doubles them, against one plain forward (per block only where the model's does not
    hold)."""
    every = _all_groups(model)
    if not every:
        return []
    every_names = tuple(n for groups in every.values() for _, names in groups for n in names)
    found = guarded("norms", None, every_names, lambda: [_read_all(model, every)])
    if not isinstance(found[0], tuple):
        return found
    results, logits = found[0]
    return results + _attributed(model, every, lambda chosen: _written_and_frozen(model, chosen, logits))


def _scales(chosen: dict) -> list[tuple[int | None, str]]:
    """``(layer, name)`` of every scale ``chosen`` (`_all_groups`' shape) serves, in its order."""
    return [(index, name) for index, groups in chosen.items() for _, names in groups for name in names
            if name.endswith("_scale")]


def _attributed(model: Any, every: dict, run: Any) -> list[CheckResult]:
    """``run(groups)`` on every norm at once (a list of ``(error, bar, note, held)``); where one fails (or it raises),
    on each block's norms alone, so that a failure puts that block's scales in doubt only."""
    scales: dict = {}
    for index, name in _scales(every):
        scales.setdefault(index, []).append(name)
    if not scales:
        return []
    try:
        outcomes = run({index: every[index] for index in scales})
    except Exception:
        outcomes = None
    if outcomes is not None and all(held for *_, held in outcomes):
        return [CheckResult("norms", index, tuple(names), True, error, tolerance, note)
                for index, names in scales.items() for error, tolerance, note, _ in outcomes]
    results = []
    for index, names in scales.items():
        def alone(index: int | None = index, names: tuple = tuple(names)) -> list[CheckResult]:
            return [CheckResult("norms", index, names, held, error, tolerance, note)
                    for error, tolerance, note, held in run({index: every[index]})]
        results += guarded("norms", index, tuple(names), alone)
    return results


def _read_all(model: Any, every: dict) -> tuple[list[CheckResult], torch.Tensor]:
    """Every norm value of the model in one trace, against plain hooks on the norms and their sublayers."""
    modules, consumers = {}, {}
    for index, groups in every.items():
        for site, names in groups:
            modules[(index, site.path)] = site.envoy._module
            if index is None:
                continue
            role = _role(model, index, names[0])
            component = _PRE.get(role) or _POST.get(role)
            envoy = model.layers[index].__dict__.get(component) if component else None
            if envoy is not None and hasattr(envoy, "_module"):
                consumers[(index, f"{component}@")] = envoy._module
    seen, handles = _first_calls({**modules, **consumers})
    saved: dict = {}
    try:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            for index, groups in every.items():
                for _, names in groups:
                    for name in names:
                        saved[index, name] = _read(model, index, name).save()
            logits = model.logits.save()
    finally:
        for handle in handles:
            handle.remove()
    results = []
    for index, groups in every.items():
        for site, names in groups:
            results += guarded("norms", index, names, lambda index=index, site=site, names=names: _formula(
                model, index, site, names, seen, saved, modules))
    return results, logits


def _as_received(site: Any, value: torch.Tensor) -> torch.Tensor:
    """A norm value between the served layout (sequence-first) and the one its norm receives (``[b, H, s, ...]``
    where heads-first): the same transpose either way."""
    return value.transpose(1, 2) if site.heads_first else value


def _last(site: Any) -> tuple:
    """The index of the last position of a scale in its norm's own layout."""
    return (slice(None), slice(None), -1) if site.heads_first else (slice(None), -1)


def _formula(model: Any, index: int | None, site: Any, names: list[str], seen: dict, saved: dict, modules: dict
             ) -> list[CheckResult]:
    """The formula against the norm's output, and the norm against its sublayer."""
    module = modules[(index, site.path)]
    x, out = seen[(index, site.path)]
    results = []
    for name in names:
        if name.endswith("_scale"):
            expected = _reference(module, site.anatomy, x, scale=_as_received(site, saved[index, name]))
            note = f"centred input / {name} · weight (+ bias) against {site.path}'s output"
        else:
            expected = _reference(module, site.anatomy, x, normalized=_as_received(site, saved[index, name]))
            note = f"{name} · weight (+ bias) against {site.path}'s output"
        results.append(compare("norms", index, (name,), expected, out, TOLERANCE, note))
    if index is not None:
        role = _role(model, index, names[0])
        component = _PRE.get(role) or _POST.get(role)
        if (index, f"{component}@") in seen:
            into, back = seen[(index, f"{component}@")]
            if role in _PRE:  # (up to a constant the block multiplies it by: Falcon-H1's attention multiplier)
                flat, received = out.reshape(-1).double(), into.reshape(-1).double()
                factor = float((flat @ received) / (flat @ flat)) if float(flat @ flat) else 1.0
                results.append(compare("norms", index, tuple(names), (flat * factor).to(out.dtype), into.reshape(-1),
                                       TOLERANCE, f"{site.path}'s output against what {component} receives"
                                       + ("" if factor == 1.0 else f" (times {factor:.6g})")))
            else:
                results.append(compare("norms", index, tuple(names), x.reshape(-1), back.reshape(-1), 0.0,
                                       f"{site.path}'s input against what {component} returns"))
    return results


def _written_and_frozen(model: Any, chosen: dict, logits: torch.Tensor) -> list[tuple]:
    """One trace of two invokes: in the first, every clean scale of ``chosen`` written back one ulp up (the logits
    against the clean ones); in the second, every scale doubled at the last position (the logits against plain hooks
    on the norm modules making their outputs the formula with the doubled scale). ``[(error, bar, note, held)]``."""
    scales = _scales(chosen)
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            for index, name in scales:
                value = _read(model, index, name)
                value[:] = torch.nextafter(value, torch.full_like(value, float("inf")))
            frozen = model.logits.save()
        with tracer.invoke(PROMPTS[0]):
            for index, name in scales:
                value = _read(model, index, name)
                value[:, -1] = value[:, -1] * 2
            ours = model.logits.save()
    handles = [site.envoy._module.register_forward_hook(_doubling(site), with_kwargs=True)
               for groups in chosen.values() for site, names in groups if any(n.endswith("_scale") for n in names)]
    with hooks_removed(handles), torch.no_grad():
        reference = model._module(**encode(model)).logits
    kept = compare("norms", None, (), frozen, logits, TOLERANCE)
    written = compare("norms", None, (), ours, reference, TOLERANCE)
    return [(kept.error, kept.tolerance, "every clean scale written back (one ulp up): the logits against the clean "
             "run's", kept.passed),
            (written.error, written.tolerance, "scales doubled at the last position, against plain hooks making the "
             "norms' outputs the formula with them", written.passed)]


def _doubling(site: Any) -> Any:
    """A forward hook making the norm's first output of a forward the formula with its scale doubled at the last
    position."""
    calls: list = []

    def replace(mod: Any, args: Any, kwargs: Any, out: Any) -> Any:
        calls.append(1)
        if len(calls) > 1:
            return None
        x = first_input(args, kwargs)
        h = x.float()
        axes = tuple(range(-site.anatomy.dims, 0))
        centred = h - h.mean(dim=axes, keepdim=True) if site.anatomy.kind == "layer" else h
        scale = torch.sqrt((centred * centred).mean(dim=axes, keepdim=True) + site.anatomy.eps)
        last = _last(site)
        scale[last] = scale[last] * 2
        return _reference(mod, site.anatomy, x, scale=scale)

    return replace


def check_norm_gradients(model: Any) -> list[CheckResult]:
    """``.grad`` of each norm value equals plain PyTorch's gradient of the same logit at a zero leaf a forward hook on
    the norm module adds to its scale (or normalised value) in the formula: one trace for every value, one plain
    backward for all the leaves."""
    every = _all_groups(model)
    names = tuple(n for groups in every.values() for _, listed in groups for n in listed)
    if not names:
        return []
    results = guarded("norm_gradients", None, names, lambda: _norm_gradients(model, every))
    return [CheckResult(r.check, r.layer, r.values, r.passed, r.error, r.tolerance, r.note, gradient=True)
            for r in results]


def _norm_gradients(model: Any, every: dict) -> list[CheckResult]:
    target = gradient_target(model)
    values: dict = {}
    grads: dict = {}
    with torch.enable_grad(), model.trace(PROMPTS[0], **NO_CACHE):
        for index, groups in every.items():
            for _, names in groups:
                for name in names:
                    values[index, name] = _read(model, index, name)
        logit = model.logits[target]
        with logit.backward():
            for key in reversed(list(values)):
                grads[key] = values[key].grad.save()
    expected, terms = _plain_gradients(model, every, target)
    results = []
    for (index, name), grad in grads.items():
        reference = expected[index, name]
        # A scale's gradient sums the width's terms g·N/scale in another order than plain PyTorch's, and its rounding
        # is relative to the terms, which cancel, not to the sum: the difference is measured per element against the
        # terms' size, with the rounding the g it sums carries (as large as the normalised value's gradient is
        # measured against) carried through the sum (Gemma-3n's key norms: their g, through AltUp, laurel and
        # full attention, leaves plain PyTorch itself 1e-4 of the terms from float64); a normalised value's against
        # its largest gradient (as every value's gradient is: an element's own size is no measure of the rounding
        # the model's backward leaves in it); plus the checks' absolute floor.
        bar = scaled(NORM_GRADIENT_BAR)
        if grad.shape != reference.shape:
            results.append(compare("norm_gradients", index, (name,), grad, reference, bar))
            continue
        own = reference.detach().abs().amax().expand_as(reference)
        size = terms.get((index, name), own).double() + GRADIENT_ABSOLUTE / NORM_GRADIENT_BAR
        error = float(((grad.detach().double() - reference.detach().double()).abs() / size).max())
        results.append(CheckResult("norm_gradients", index, (name,), error <= bar, error, bar,
                                   f"against a zero leaf added to {name} in a plain hook on its norm and "
                                   "torch.autograd.grad, relative to the terms it sums and their rounding (a scale) "
                                   "or its largest gradient", gradient=True))
    return results


def _plain_gradients(model: Any, every: dict, target: tuple) -> tuple[dict, dict]:
    """``(gradients, terms)``: d logit / d (a zero leaf added to the scale, and one added to the normalised value) that
    a plain forward hook on each norm makes its output from, in one backward, keyed ``(layer, name)`` and laid out as
    served; per scale, the size of the terms its gradient sums and of their rounding (see `_norm_gradients`)."""
    leaves: dict = {}  # per norm: (its scale's leaf, its normalised value's leaf, that value, the scale, the axes)
    handles = [site.envoy._module.register_forward_hook(_leaf_hook(site, leaves, (index, id(site))), with_kwargs=True)
               for index, groups in every.items() for site, _ in groups]
    try:
        with torch.enable_grad():
            output = model._module(**gradient_inputs(model))
            keys = list(leaves)
            found = gradients_at(output, lambda logits: logits[target],
                                 [leaf for key in keys for leaf in leaves[key][:2]])
    finally:
        for handle in handles:
            handle.remove()
    by_norm = {key: (found[2 * i], found[2 * i + 1]) for i, key in enumerate(keys)}
    gradients: dict = {}
    terms: dict = {}
    for index, groups in every.items():
        for site, names in groups:
            if (index, id(site)) not in by_norm:
                continue
            (of_scale, of_normalized), (leaf_scale, leaf_normalized, normalized, scale, axes) = (
                by_norm[index, id(site)], leaves[index, id(site)])
            for name in names:
                scaled_part = name.endswith("_scale")
                grad, leaf = (of_scale, leaf_scale) if scaled_part else (of_normalized, leaf_normalized)
                gradients[index, name] = _as_received(site, torch.zeros_like(leaf) if grad is None else grad)
                if scaled_part and of_normalized is not None:
                    # The terms g·N/scale it sums, and the rounding its g (dL/dN, from the model's backward) carries,
                    # as large as the normalised value's gradient is measured against (its largest), through the same
                    # sum: sum |g·N| / scale + max |g| · sum |N| / scale.
                    g = of_normalized.float()
                    size = ((g * normalized).abs().sum(dim=axes, keepdim=True)
                            + g.abs().amax() * normalized.abs().sum(dim=axes, keepdim=True)) / scale
                    terms[index, name] = _as_received(site, size.detach())
    return gradients, terms


def _leaf_hook(site: Any, leaves: dict, key: tuple) -> Any:
    """A forward hook making the norm's first output the formula of its input's centred part over its scale plus a
    zero leaf, plus a zero leaf on the normalised value: ``leaves[key]`` keeps both (their gradients are the scale's
    and the normalised value's), with the normalised value, the scale and the normalised axes."""

    def replace(mod: Any, args: Any, kwargs: Any, out: Any) -> Any:
        if key in leaves:
            return None
        x = first_input(args, kwargs)
        h = x.float()
        axes = tuple(range(-site.anatomy.dims, 0))
        centred = h - h.mean(dim=axes, keepdim=True) if site.anatomy.kind == "layer" else h
        scale = torch.sqrt((centred * centred).mean(dim=axes, keepdim=True) + site.anatomy.eps)
        # Zero leaves added where the values are used: their gradients are the values', the input's graph stays whole.
        leaf_scale = torch.zeros_like(scale).requires_grad_()
        normalized = (centred / (scale + leaf_scale)).to(x.dtype)
        leaf_normalized = torch.zeros_like(normalized).requires_grad_()
        leaves[key] = (leaf_scale, leaf_normalized, normalized.detach().float(), scale.detach(), axes)
        return _reference(mod, site.anatomy, x, normalized=normalized + leaf_normalized)

    return replace
