"""TransformerLens's ``ln1/ln2.hook_normalized`` on every registered variant: the norm's input normalised before its
weight and bias, as TransformerLens computes it, or refused with the block's reason.

- ``value_at(model, "blocks.L.ln1/ln2.hook_normalized")`` equals the formula (``centred / sqrt(mean(centred²) + eps)``)
  computed from the norm module's input, read by a plain forward pre-hook on the unwrapped model.
- A dictionary attached at ``ln2.hook_normalized``: its features are its encoding of that formula value; with the
  error term the logits are the clean run's bit for bit; without it, they are the logits of a plain forward hook on
  the norm module that makes its output ``reconstruction · (offset + weight) (+ bias)`` (1e-5).
- ``ln_final.hook_normalized`` is ``model.final_normalized``, the same formula on the final norm's input; a write of
  ``ln2.hook_normalized`` through `value_at` equals the same edit by a plain forward hook on the norm module.

One block per variant (the last), a few traces each.
"""

from __future__ import annotations

import pytest
import torch

from nncanon.errors import ValueNotAvailable
from nncanon.proof.checks.references import encode
from nncanon.reading import host
from nncanon.sae import Dictionary, attach, resolve, value_at
from nncanon.sae.sites import point_shape
from nncanon.testing import PROMPTS

#: TransformerLens suffix -> the nncanon values it may name (the first the block serves).
NAMES = {"ln1.hook_normalized": ("attention_normalized", "linear_attention_normalized"),
         "ln2.hook_normalized": ("mlp_normalized",)}


def _formula(anatomy, x: torch.Tensor) -> torch.Tensor:
    """``x`` centred (a LayerNorm) over the normalised axes, divided by ``sqrt(mean(centred²) + eps)``, in float32."""
    h = x.float()
    axes = tuple(range(-anatomy.dims, 0))
    if anatomy.kind == "layer":
        h = h - h.mean(axes, keepdim=True)
    return h / (h.pow(2).mean(axes, keepdim=True) + anatomy.eps).sqrt()


def _served(model, layer: int) -> dict:
    """``suffix -> (value, NormSite)`` for the names block ``layer`` serves; ``suffix -> reason`` for the others."""
    report = model.support()
    found = {}
    for suffix, values in NAMES.items():
        mixer = "self_attn" if report.available("self_attn", layer=layer) else "linear_attn"
        value = values[0] if suffix.startswith("ln2") else ("attention_normalized" if mixer == "self_attn"
                                                            else "linear_attention_normalized")
        reason = report.reason(value, layer=layer)
        if suffix.startswith("ln1") and not report.available(mixer, layer=layer):
            reason = report.reason("self_attn", layer=layer)
        found[suffix] = reason if reason is not None else (value, host(model, layer, value)._nncanon.norms[value].site)
    return found


def _reference_inputs(model, sites: list) -> list[torch.Tensor]:
    """The first input of each norm module at its first call in a plain forward of the unwrapped model."""
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for index, site in enumerate(sites):
        def pre(module, args, kwargs, index=index):
            seen.setdefault(index, (args[0] if args else next(iter(kwargs.values()))).detach().clone())
        handles.append(site.envoy._module.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            model._module(**encode(model))
    finally:
        for handle in handles:
            handle.remove()
    return [seen[index] for index in range(len(sites))]


def test_hook_normalized_is_the_formula_or_refused(model, variant):
    layer = model.num_layers - 1
    served = _served(model, layer)
    for suffix, entry in served.items():
        if isinstance(entry, str):
            with pytest.raises(ValueNotAvailable, match="not available"):
                resolve(model, f"blocks.{layer}.{suffix}")
            continue
        assert resolve(model, f"blocks.{layer}.{suffix}").value == entry[0]
    names = [s for s, e in served.items() if not isinstance(e, str)]
    if not names:
        return
    ours: list = []
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for suffix in names:
            ours.append(value_at(model, f"blocks.{layer}.{suffix}").save())
    inputs = _reference_inputs(model, [served[s][1] for s in names])
    for suffix, value, x in zip(names, ours, inputs, strict=True):
        expected = _formula(served[suffix][1].anatomy, x).to(x.dtype)
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5, msg=lambda m, s=suffix: f"{s}: {m}")


def _dictionary(model, point) -> Dictionary:
    shape, dtype, _ = point_shape(model, point)
    width = shape[-1]
    generator = torch.Generator().manual_seed(7)
    scale = 1.0 / width ** 0.5
    return Dictionary.from_tensors(
        torch.randn(width, 8, generator=generator) * scale, torch.full((8,), 0.01),
        torch.randn(8, width, generator=generator) * scale, torch.randn(width, generator=generator) * 0.01,
        name="ln2-normalized").to(dtype=dtype)


def test_dictionary_at_ln2_hook_normalized(model, variant):
    layer = model.num_layers - 1
    entry = _served(model, layer)["ln2.hook_normalized"]
    name = f"blocks.{layer}.ln2.hook_normalized"
    if isinstance(entry, str):
        with pytest.raises(ValueNotAvailable):
            resolve(model, name)
        return
    site = entry[1]
    module = site.envoy._module
    point = resolve(model, name)
    dictionary = _dictionary(model, point)
    x = _reference_inputs(model, [site])[0]
    normalized = _formula(site.anatomy, x).to(x.dtype)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        clean = model.logits.save()
    with attach(model, dictionary, name) as sae:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            features = sae.features.save()
            spliced = model.logits.save()
    assert torch.equal(spliced, clean)
    torch.testing.assert_close(features, dictionary.encode(normalized), rtol=1e-5, atol=1e-5)
    with attach(model, dictionary, name, error_term=False):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            replaced = model.logits.save()
    reconstruction = dictionary.decode(dictionary.encode(normalized)).float()
    calls = []

    def replace(module, args, out):
        calls.append(1)
        if len(calls) > 1:
            return None
        y = reconstruction * (module.weight.float() + site.anatomy.offset) if getattr(module, "weight", None) \
            is not None else reconstruction * (site.anatomy.offset or 1.0)
        if getattr(module, "bias", None) is not None:
            y = y + module.bias.float()
        return y.to(out.dtype) if not isinstance(out, tuple) else (y.to(out[0].dtype), *out[1:])

    handle = module.register_forward_hook(replace)
    try:
        with torch.no_grad():
            reference = model._module(**encode(model)).logits
    finally:
        handle.remove()
    torch.testing.assert_close(replaced, reference, rtol=1e-5, atol=1e-5)


def test_ln_final_hook_normalized_is_the_formula_or_refused(model, variant):
    """``ln_final.hook_normalized`` is ``model.final_normalized``: the final norm's input normalised before its
    weight, or refused with the model's reason."""
    if isinstance(model.__dict__.get("_final_norm"), str) or "final_normalized" in model._model_declines:
        with pytest.raises(ValueNotAvailable, match="not available"):
            resolve(model, "ln_final.hook_normalized")
        return
    point = resolve(model, "ln_final.hook_normalized")
    assert (point.layer, point.value) == (None, "final_normalized")
    site = model._final_norm["final_normalized"].site
    with torch.no_grad(), model.trace(PROMPTS[0]):
        ours = value_at(model, "ln_final.hook_normalized").save()
    x = _reference_inputs(model, [site])[0]
    torch.testing.assert_close(ours, _formula(site.anatomy, x).to(x.dtype), rtol=1e-5, atol=1e-5)


def test_a_write_of_ln2_hook_normalized_equals_a_plain_hook(model, variant):
    """Doubling ``ln2.hook_normalized`` at the last position through `value_at` gives the logits of a plain forward
    hook on the norm module that makes its output there ``2 · normalized · (offset + weight) (+ bias)``."""
    layer = model.num_layers - 1
    entry = _served(model, layer)["ln2.hook_normalized"]
    if isinstance(entry, str):
        return
    site = entry[1]
    with torch.no_grad(), model.trace(PROMPTS[0]):
        value = value_at(model, f"blocks.{layer}.ln2.hook_normalized")
        value[:, -1] = value[:, -1] * 2
        ours = model.logits.save()
    calls = []

    def replace(module, args, out):
        calls.append(1)
        if len(calls) > 1:
            return None
        y = _formula(site.anatomy, args[0])
        y[:, -1] = y[:, -1].to(args[0].dtype).float() * 2
        if getattr(module, "weight", None) is not None:
            y = y * (module.weight.float() + site.anatomy.offset)
        if getattr(module, "bias", None) is not None:
            y = y + module.bias.float()
        first = out[0] if isinstance(out, tuple) else out
        mixed = first.clone()
        mixed[:, -1] = y[:, -1].to(first.dtype)
        return (mixed, *out[1:]) if isinstance(out, tuple) else mixed

    handle = site.envoy._module.register_forward_hook(replace)
    try:
        with torch.no_grad():
            reference = model._module(**encode(model)).logits
    finally:
        handle.remove()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_hook_result_is_each_heads_output_through_its_slice_of_the_projection_or_refused(model, variant):
    """TransformerLens's ``attn.hook_result`` (``z[:, :, h] @ W_O[h]``, no bias) against the output projection
    module's own forward, run by plain PyTorch on its input (a plain forward hook's) with every other head's slice
    zeroed, less its output on zeros (the bias); the heads sum to the module's output less the bias."""
    from nncanon.tools.heads import output_projection

    layer = model.num_layers - 1
    name = f"blocks.{layer}.attn.hook_result"
    reason = model.support().reason("attention_head_outputs", layer=layer)
    try:
        point = resolve(model, name)
    except ValueNotAvailable as error:  # refused with a property of the block
        assert reason is not None or any(words in str(error) for words in (
            "no per-head output projection", "not one matrix from the", "one of several attentions")), str(error)
        return
    assert reason is None and point.value == "attention_head_contributions"
    module = output_projection(model, layer)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        result = value_at(model, name).save()
        one = value_at(model, name, head=1 % result.shape[-2]).save()
    seen = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append((args[0].detach().clone(), out.detach())))
    try:
        with torch.no_grad():
            model._module(**encode(model))
    finally:
        handle.remove()
    x, out = seen[0]
    heads = result.shape[-2]
    width = x.shape[-1] // heads
    with torch.no_grad():
        bias = type(module).forward(module, torch.zeros_like(x))
        expected = []
        for h in range(heads):
            masked = torch.zeros_like(x)
            masked[..., h * width:(h + 1) * width] = x[..., h * width:(h + 1) * width]
            expected.append(type(module).forward(module, masked) - bias)
    torch.testing.assert_close(result, torch.stack(expected, dim=-2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result.sum(-2) + bias, out, rtol=1e-4, atol=1e-5)
    assert torch.equal(one, result[..., 1 % heads, :])
