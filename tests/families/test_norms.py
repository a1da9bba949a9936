"""Every norm's scale and the stream it normalises before its weight, on every registered variant.

The checks that prove them are the verifier's (``norms``, ``norm_gradients``, ``invokes``: they run in
``test_invariants.py::test_check_holds``). Here: every block serves each norm value or declines it for a reason that
is a property of the block; a scale written on the first and the last block equals the same edit made by a plain
PyTorch forward hook on the norm module, which computes the formula itself (the logits); the TransformerLens names
resolve to them.
"""

from __future__ import annotations

import pytest
import torch

from nncanon.components.norms import FINAL_VALUES, NORM_VALUES, ROLES
from nncanon.proof.checks.references import encode
from nncanon.reading import host
from nncanon.sae import resolve
from nncanon.testing import PROMPTS

#: What a norm value's reason may say: each is a property of the block (it has no such norm, one norm feeds two
#: sublayers, its norm is gated or names no epsilon, it has no such component, it does not run, post-LN OPT).
PROPERTIES = ("has no", "have no", "calls no norm", "parallel block: one norm feeds both", "is gated",
              "names no epsilon", "takes its epsilon", "post-LN", "does not run", "flattened", "runs twice",
              "is not a norm", "no norm of one stream", "one norm module per head")


def test_every_block_serves_its_norms_or_says_why(model, variant):
    """Each norm value is served, or its reason is a property of the block; a block with softmax attention and an MLP
    serves the norm before attention and the one before its MLP unless it is a parallel or post-norm-only block."""
    report = model.support()
    for index in range(model.num_layers):
        for value in NORM_VALUES:
            reason = report.reason(value, layer=index)
            if reason is not None:
                assert any(phrase in reason for phrase in PROPERTIES), f"layers[{index}].{value}: {reason}"
        for before, value in (("query_states_before_norm", "query_norm_scale"),
                              ("key_states_before_norm", "key_norm_scale")):  # (heads-first norms too: Gemma-3)
            if report.available(before, layer=index):
                reason = report.reason(value, layer=index)
                assert reason is None or any(p in reason for p in ("is gated", "epsilon", "one norm module per head")
                                             ), reason
        if report.available("self_attn", layer=index) and report.available("mlp", layer=index):
            for value in ("attention_norm_scale", "mlp_norm_scale"):
                reason = report.reason(value, layer=index)
                assert reason is None or any(p in reason for p in ("parallel block", "calls no norm", "post-LN",
                                                                   "flattened")), reason


def _scale_formula(module: torch.nn.Module, x: torch.Tensor, anatomy, doubled: bool, length: int) -> torch.Tensor:
    """The norm's output written out here: ``x`` centred (a LayerNorm) over its root mean square plus eps (doubled at
    the last position: the axis of length ``length``, the second, or the third where the norm receives its heads
    first, ``[b, H, s, d]``), times ``offset + weight``, plus the bias."""
    h = x.float()
    if anatomy.kind == "layer":
        h = h - h.mean(-1, keepdim=True)
    scale = (h.pow(2).mean(-1, keepdim=True) + anatomy.eps).sqrt()
    if doubled:
        heads_first = x.dim() == 4 and x.shape[1] != length
        assert x.shape[2 if heads_first else 1] == length, (tuple(x.shape), length)
        if heads_first:
            scale[:, :, -1] *= 2
        else:
            scale[:, -1] *= 2
    out = h / scale
    if getattr(module, "weight", None) is not None:
        out = out * (module.weight.float() + anatomy.offset)
    if getattr(module, "bias", None) is not None:
        out = out + module.bias.float()
    return out.to(x.dtype)


def test_scale_write_equals_plain_hook(model, variant):
    """On the first and last block (and the final norm): each scale doubled at the last position gives the logits a
    plain forward hook on the norm module gives when it makes its output the formula with that scale."""
    report = model.support()
    checked = 0
    for index in sorted({0, model.num_layers - 1}):
        for value in NORM_VALUES:
            if not value.endswith("_scale") or not report.available(value, layer=index):
                continue
            owner = host(model, index, value)
            binding = owner._nncanon.norms[value]
            _assert_write_matches(model, lambda owner=owner, value=value: getattr(owner, value), binding.site)
            checked += 1
    if _final_served(model):
        _assert_write_matches(model, lambda: model.final_norm_scale, model._final_norm["final_norm_scale"].site)
        checked += 1
    assert checked or all(not report.available(v, layer=0) for v in NORM_VALUES)


def _assert_write_matches(model, value, site) -> None:
    with torch.no_grad(), model.trace(PROMPTS[0]):
        scale = value()
        scale[:, -1] = scale[:, -1] * 2
        ours = model.logits.save()
    calls = []
    inputs = encode(model)
    length = inputs["input_ids"].shape[1]

    def replace(module, args, kwargs, out):
        calls.append(1)
        if len(calls) == 1:
            return _scale_formula(module, args[0] if args else next(iter(kwargs.values())), site.anatomy, True,
                                  length)
        return None

    handle = site.envoy._module.register_forward_hook(replace, with_kwargs=True)
    try:
        with torch.no_grad():
            reference = model._module(**inputs).logits
    finally:
        handle.remove()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_nothing_written_is_bit_identical(model, variant):
    """Reading every norm value of the first block (and the final norm's) leaves the logits bit-identical."""
    report = model.support()
    names = [v for v in NORM_VALUES if report.available(v, layer=0)]
    with torch.no_grad(), model.trace(PROMPTS[0]):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for name in sorted(names, key=list(report.layers[0].reasons).index):
            getattr(host(model, 0, name), name).save()
        read = model.logits.save()
    assert torch.equal(clean, read)


def test_transformer_lens_scale_names_resolve(model, variant):
    """``blocks.L.ln1/ln2(_post).hook_scale`` and ``ln_final.hook_scale`` name the norm values, or are refused with
    the block's reason."""
    from nncanon.errors import ValueNotAvailable

    report = model.support()
    names = {"ln1.hook_scale": ("attention_norm_scale", "linear_attention_norm_scale"),
             "ln2.hook_scale": ("mlp_norm_scale",),
             "ln1_post.hook_scale": ("attention_post_norm_scale", "linear_attention_post_norm_scale"),
             "ln2_post.hook_scale": ("mlp_post_norm_scale",)}
    for suffix, values in names.items():
        served = [v for v in values if report.available(v, layer=0)]
        if served:
            assert resolve(model, f"blocks.0.{suffix}").value == served[0]
        else:
            with pytest.raises(ValueNotAvailable):
                resolve(model, f"blocks.0.{suffix}")
    if not _final_served(model):
        with pytest.raises(ValueNotAvailable):
            resolve(model, "ln_final.hook_scale")
    else:
        assert resolve(model, "ln_final.hook_scale").value == "final_norm_scale"


def _final_served(model) -> bool:
    """Whether the model serves its final norm's scale (it has one that is a norm, and its family does not decline
    it)."""
    return not isinstance(model.__dict__.get("_final_norm"), str) and "final_norm_scale" not in model._model_declines


def test_roles_are_complete():
    """Every role names a served value, and the final norm's values are apart."""
    assert {name for _, scale, normalized in ROLES.values() for name in (scale, normalized) if name} == set(NORM_VALUES)
    assert not set(FINAL_VALUES) & set(NORM_VALUES)
