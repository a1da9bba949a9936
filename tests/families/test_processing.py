"""A dictionary's recorded TransformerLens processing, on every registered variant: what it reads is the plain-torch
formula of the processing applied to the value plain forward hooks read on the unwrapped model.

- ``center_writing_weights``: at ``hook_resid_post`` and ``hook_mlp_out`` a dictionary reads ``x - x.mean(-1)`` on a
  model whose norms are ``torch.nn.LayerNorm``, and ``x`` itself on one whose final norm is an RMSNorm (a no-op, as
  TransformerLens skips it); an edit of a feature still moves the model's value by exactly ``δ · W_dec[j]``, and an
  unedited trace leaves the logits bit for bit.
- ``fold_value_biases``: at ``hook_z`` it reads ``z - b_V`` (each head's), and ``b_V`` is what TransformerLens folds:
  the heads' outputs less ``b_V`` are the softmax pattern times the values less ``b_V``
  (``hook_z == pattern @ hook_v``, TransformerLens's definition, on the served pattern and values).
- ``mlp.hook_out``: where it resolves, the MLP module's output as a plain forward hook reads it (an MLP run inline:
  its down projection's).
"""

from __future__ import annotations

import pytest
import torch

from nncanon.errors import DictionaryMismatch, NncanonError
from nncanon.proof.checks.references import encode, site_references
from nncanon.reading import in_execution_order
from nncanon.sae import Dictionary, attach, resolve, value_at
from nncanon.sae.processing import CENTRING_REFUSED, norm_kind, value_bias
from nncanon.sae.sites import point_shape
from nncanon.testing import PROMPTS

FEATURES, DELTA, FEATURE = 8, 0.75, 3


def _dictionary(width: int, hook: str, record: dict, dtype: torch.dtype, seed: int = 0) -> Dictionary:
    generator = torch.Generator().manual_seed(seed)
    scale = 1.0 / width ** 0.5
    return Dictionary.from_tensors(
        torch.randn(width, FEATURES, generator=generator) * scale, torch.full((FEATURES,), 0.01),
        torch.randn(FEATURES, width, generator=generator) * scale, torch.randn(width, generator=generator) * 0.01,
        hook_name=hook, model_from_pretrained_kwargs=record).to(dtype=dtype)


def _last_with(model, value: str) -> int | None:
    report = model.support()
    layers = [layer for layer in range(model.num_layers) if report.available(value, layer=layer)]
    return layers[-1] if layers else None


def _final_norm_kind(model) -> str | None:
    """The final norm's kind told by its class (independent of the probe `norm_kind` runs), or ``None``."""
    norm = getattr(model, "norm", None)
    if norm is None:
        return None
    module = norm._module
    if isinstance(module, torch.nn.LayerNorm):
        return "LayerNorm"
    return "RMSNorm" if "rms" in type(module).__name__.lower() else None


def test_center_writing_weights_reads_the_centred_stream_on_layernorm_models(variant, model):
    layer = model.num_layers - 1
    if getattr(model, "norm", None) is None:  # nothing tells LayerNorm from RMSNorm: refused, with the reason
        width = model._text_config.hidden_size
        with pytest.raises(DictionaryMismatch, match="no final norm"):
            attach(model, _dictionary(width, "blocks.0.hook_resid_post", {"center_writing_weights": True},
                                      model.dtype), "blocks.0.hook_resid_post")
        return
    try:
        kind = norm_kind(model)
    except DictionaryMismatch:  # a final norm over several streams: refused at attach, with the reason
        name = f"blocks.{layer}.hook_resid_post"
        shape, dtype, _ = point_shape(model, resolve(model, name))
        with pytest.raises(DictionaryMismatch, match="cannot tell"):
            attach(model, _dictionary(shape[-1], name, {"center_writing_weights": True}, dtype))
        return
    config = model._text_config
    if kind == "LayerNorm" and (config.model_type in CENTRING_REFUSED or getattr(config, "do_layer_norm_before", True)
                                is False or getattr(config, "apply_residual_connection_post_layernorm", False)):
        name = f"blocks.{layer}.hook_resid_post"
        shape, dtype, _ = point_shape(model, resolve(model, name))
        with pytest.raises(DictionaryMismatch, match="nncanon does not reproduce it"):
            attach(model, _dictionary(shape[-1], name, {"center_writing_weights": True}, dtype))
        return
    told = _final_norm_kind(model)
    if told is not None:
        assert kind == told, f"{variant.name}: the probe says {kind}, the final norm is a {told}"
    inputs = encode(model)
    values = [v for v in ("layer_output", "mlp_output") if model.support().available(v, layer=layer)]
    references = site_references(model, [(layer, value) for value in values], inputs)
    with torch.no_grad():
        clean = model._module(**inputs).logits
    items = {}
    for value, hook in (("mlp_output", "hook_mlp_out"), ("layer_output", "hook_resid_post")):
        if value not in values:
            continue
        reference = references[layer, value]
        name = f"blocks.{layer}.{hook}"
        items[value] = attach(model, _dictionary(reference.shape[-1], name, {"center_writing_weights": True},
                                                 reference.dtype), name)
    try:
        saved: dict = {}
        with torch.no_grad(), model.trace(PROMPTS[0]):
            for value, item in items.items():
                saved[value] = item.features.save()
            logits = model.logits.save()
        assert torch.equal(logits, clean), f"{variant.name}: unedited dictionaries moved the logits"
        for value, item in items.items():
            x = references[layer, value]
            expected = x - x.mean(dim=-1, keepdim=True) if kind == "LayerNorm" else x
            assert torch.equal(saved[value], item.dictionary.encode(expected)), f"{variant.name} {value}"
            assert ("centred" in item.describe()) == (kind == "LayerNorm"), item.describe()
        # an edit moves the model's value by exactly δ · W_dec[j] (the offset of the read is handed back)
        item = items["layer_output"]
        with torch.no_grad(), model.trace(PROMPTS[0]):
            item.features[..., FEATURE] += DELTA
            after = value_at(model, item.point).save()
        before = references[layer, "layer_output"]
        error = (after - before - DELTA * item.dictionary.W_dec[FEATURE]).abs().max().item()
        assert error <= 1e-5 * max(1.0, before.abs().max().item()), f"{variant.name}: |Δ - δ·W_dec[j]| = {error}"
    finally:
        for item in items.values():
            item.detach()


def test_fold_value_biases_reads_the_heads_less_their_value_bias(variant, model):
    layer = _last_with(model, "attention_head_outputs")
    if layer is None:
        return
    report = model.support()
    if any(report.reason(v, layer=layer) for v in ("attention_input", "value_states", "attention_probabilities")):
        return  # the measure reads these: refused with the reason (tests/sae/test_processing.py)
    name = f"blocks.{layer}.attn.hook_z"
    try:
        bias = value_bias(model, layer, "attention_head_outputs")
    except DictionaryMismatch as error:  # the fold is not exact on this attention: refused, with the numbers
        assert "fold_value_biases" in str(error)
        return
    names = in_execution_order(model, layer, ["value_states", "attention_probabilities", "attention_head_outputs"])
    read: dict = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for value in names:
            read[value] = getattr(model.layers[layer].self_attn, value).save()
    z, v, pattern = read["attention_head_outputs"], read["value_states"], read["attention_probabilities"]
    groups = z.shape[-2] // v.shape[-2]
    per_kv = value_bias(model, layer, "value_states")
    assert torch.equal(per_kv.repeat_interleave(groups, dim=0), bias)
    # TransformerLens's hook_z == pattern @ hook_v, with both less b_V: where the heads are the pattern times the
    # values (no output gate, sink or window the pattern leaves out), the bias is the one that identity moves
    plain = torch.einsum("bhqk,bkhd->bqhd", pattern.to(v.dtype), v.repeat_interleave(groups, dim=2))
    tolerance = 1e-4 if z.dtype == torch.float32 else 3e-2
    scale = max(1.0, z.abs().max().item())
    if plain.shape == z.shape and (plain - z).abs().max().item() <= tolerance * scale:
        z_tl = torch.einsum("bhqk,bkhd->bqhd", pattern.to(v.dtype), (v - per_kv).repeat_interleave(groups, dim=2))
        assert (z - bias - z_tl).abs().max().item() <= tolerance * scale, variant.name
    else:  # the heads are not pattern @ values: the fold is accepted only where there is no value bias to move
        assert not bias.any(), f"{variant.name}: b_V measured where the heads are not the pattern times the values"
    width = z.shape[-2] * z.shape[-1]
    item = attach(model, _dictionary(width, name, {"fold_value_biases": True}, z.dtype), name)
    try:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            features = item.features.save()
        assert torch.equal(features, item.dictionary.encode(z - bias)), variant.name
    finally:
        item.detach()


def test_mlp_hook_out_is_the_mlp_modules_output(variant, model):
    layer = _last_with(model, "mlp_output")
    if layer is None:
        return
    try:
        point = resolve(model, f"blocks.{layer}.mlp.hook_out")
    except NncanonError as error:
        assert "MLP" in str(error) or "mlp" in str(error)
        return
    captured: list = []
    mlp = model.layers[layer].mlp  # (an MLP run inline, OPT's: its down projection, on the tokens flattened)
    module = mlp._module if hasattr(mlp, "_module") else model.layers[layer]._module.get_submodule(
        mlp._nncanon.anatomy.down)
    handle = module.register_forward_hook(lambda m, a, out: captured.append(out))
    inputs = encode(model)
    try:
        with torch.no_grad():
            model._module(**inputs)
    finally:
        handle.remove()
    reference = captured[0]
    if isinstance(reference, tuple):  # (its first element; the rest passed on: gpt-oss's router scores, RWKV's state)
        reference = reference[0]
    if not isinstance(reference, torch.Tensor):
        pytest.fail(f"{variant.name}: mlp.hook_out resolved where the MLP returns a {type(reference).__name__}")
    with torch.no_grad(), model.trace(PROMPTS[0]):
        ours = value_at(model, point).save()
    assert torch.equal(ours, reference.reshape(ours.shape)), variant.name
