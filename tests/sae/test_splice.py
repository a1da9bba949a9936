"""An attached dictionary in a trace, against plain PyTorch hooks on the unwrapped model.

The reference runs ``model._module`` (the bare transformers model) with a forward hook on block 1 that reads its
output, or replaces it: ``x + δ·W_dec[j]`` for an edit, the reconstruction for ``error_term=False``.
"""

from __future__ import annotations

import pytest
import torch

from nncanon import (
    DictionaryMismatch,
    InvalidLayer,
    InvalidWrite,
    NestedTrace,
    NotInTrace,
    UnknownHookName,
    ValueNotAvailable,
)
from nncanon.proof.checks.references import encode, hf_block
from nncanon.sae import Dictionary, attach, attached
from nncanon.testing import PROMPTS, tiny_model

from . import block_output_and_gradient

LAYER, FEATURES = 1, 16


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _sae(model, hook: str = "blocks.1.hook_resid_post", seed: int = 0, **kw) -> Dictionary:
    d = model.hidden_size
    g = torch.Generator().manual_seed(seed)
    return Dictionary.from_tensors(torch.randn(d, FEATURES, generator=g) / d ** 0.5, torch.full((FEATURES,), 0.05),
                                   torch.randn(FEATURES, d, generator=g) / d ** 0.5,
                                   torch.randn(d, generator=g) * 0.01, hook_name=hook, **kw)


def _hooked(model, layer: int = LAYER, replace=None, inputs=None):
    """``(block output, logits)`` of the bare model, the block's output replaced by ``replace(output)`` if given."""
    seen = {}

    def hook(module, args, output):
        tensor = output[0] if isinstance(output, tuple) else output
        seen["x"] = tensor.clone()
        if replace is None:
            return None
        new = replace(tensor)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    handle = hf_block(model, layer).register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model._module(**(inputs or encode(model))).logits
    finally:
        handle.remove()
    return seen["x"], logits


def test_features_are_the_encoding_of_the_value_plain_hooks_read_and_the_run_is_clean(model):
    sae = _sae(model)
    x, clean = _hooked(model)
    with attach(model, sae) as item, torch.no_grad(), model.trace(PROMPTS[0]):
        features = item.features.save()
        reconstruction = item.reconstruction.save()
        error = item.error.save()
        logits = model.logits.save()
    assert torch.equal(features, sae.encode(x))
    assert torch.equal(logits, clean)
    assert torch.equal(reconstruction, sae(x)) and torch.equal(error, x - sae(x))


def test_an_edit_is_x_plus_delta_times_the_decoder_row(model):
    sae = _sae(model)
    x, _ = _hooked(model)
    j, delta = int(sae.encode(x)[0, -1].argmax()), 1.25
    _, expected = _hooked(model, replace=lambda t: t + delta * sae.W_dec[j])
    with attach(model, sae) as item, torch.no_grad(), model.trace(PROMPTS[0]):
        item.features[..., j] += delta
        value = model.layers[LAYER].layer_output.save()
        logits = model.logits.save()
    assert torch.equal(value, x + delta * sae.W_dec[j])
    assert torch.equal(logits, expected)


def test_without_the_error_term_the_value_is_the_reconstruction_in_every_trace(model):
    sae = _sae(model)
    _, clean = _hooked(model)
    _, expected = _hooked(model, replace=sae)
    item = attach(model, sae, error_term=False)
    try:
        assert any("replacing the value by the reconstruction" in line for line in model.support().attached)
        with torch.no_grad(), model.trace(PROMPTS[0]):  # the features are not read: the edit replaces the value
            logits = model.logits.save()
        assert torch.equal(logits, expected)
        with torch.no_grad(), model.trace() as tracer:  # read in one invoke, edited in another
            with tracer.invoke(PROMPTS[0]):
                features = item.features.save()
            with tracer.invoke(PROMPTS[0]):
                item.features[..., 0] = 0
                edited = model.logits.save()
        x, _ = _hooked(model)
        assert torch.equal(features, sae.encode(x))
        ablated = sae.encode(x)
        ablated[..., 0] = 0
        _, reference = _hooked(model, replace=lambda t: sae.decode(ablated))
        torch.testing.assert_close(edited, reference, rtol=1e-5, atol=1e-5)
    finally:
        item.detach()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        after = model.logits.save()
    assert torch.equal(after, clean) and not model.support().attached


def test_an_edit_in_one_invoke_touches_its_rows_only(model):
    sae = _sae(model)
    rows: list = []
    with attach(model, sae) as item, torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            rows.append(model.logits.save())
        with tracer.invoke(PROMPTS[1]):
            item.features[:, -1] = 0
            rows.append(model.logits.save())
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            untouched = model.logits.save()
        with tracer.invoke(PROMPTS[1]):
            model.layers[0].layer_input
            plain = model.logits.save()
    assert torch.equal(rows[0], untouched) and not torch.equal(rows[1], plain)


def test_writes_are_checked_and_a_failed_trace_leaves_the_next_clean(model):
    sae = _sae(model)
    _, clean = _hooked(model)
    with attach(model, sae) as item:
        with pytest.raises(InvalidWrite, match="expects shape"):
            with model.trace(PROMPTS[0]):
                item.features = torch.zeros(3)
        with pytest.raises(InvalidWrite, match="dtype"):
            with model.trace(PROMPTS[0]):
                item.features = torch.zeros(FEATURES, dtype=torch.float64)
        with pytest.raises(InvalidWrite, match="read-only"):
            with model.trace(PROMPTS[0]):
                item.reconstruction = torch.zeros(1)
        with torch.no_grad(), model.trace(PROMPTS[0]):
            item.features = torch.zeros(FEATURES)  # an assignment, broadcast
            zeroed = model.layers[LAYER].layer_output.save()
        x, _ = _hooked(model)
        torch.testing.assert_close(zeroed, x - (sae.encode(x) @ sae.W_dec), rtol=0, atol=1e-6)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        logits = model.logits.save()
    assert torch.equal(logits, clean)


def test_feature_gradient_is_the_decoder_times_the_value_gradient_and_the_rest_is_clean(model):
    sae = _sae(model)
    token = 5
    _, value_grad = block_output_and_gradient(model, LAYER, token)
    with attach(model, sae) as item, model.trace(PROMPTS[0]):
        entering = model.layers[0].layer_input
        features = item.features
        logit = model.logits[0, -1, token]
        with logit.backward():
            feature_grad = features.grad.save()
            entering_grad = entering.grad.save()
    model._module.zero_grad(set_to_none=True)
    with model.trace(PROMPTS[0]):
        entering = model.layers[0].layer_input
        logit = model.logits[0, -1, token]
        with logit.backward():
            clean_grad = entering.grad.save()
    model._module.zero_grad(set_to_none=True)
    torch.testing.assert_close(feature_grad, value_grad @ sae.W_dec.T, rtol=1e-5, atol=1e-6)
    assert torch.equal(entering_grad, clean_grad)


def test_several_dictionaries_at_once(model):
    first, second = _sae(model, "blocks.0.hook_resid_post", seed=1), _sae(model, "blocks.1.hook_mlp_out", seed=2)
    with attach(model, first) as a, attach(model, second) as b:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            a.features[..., 2] += 1.0
            before = model.layers[1].mlp.mlp_output.clone().save()
            b.features[..., 3] -= 0.5
            after = model.layers[1].mlp.mlp_output.save()
        assert len(model.support().attached) == 2
    assert torch.equal(after, before - 0.5 * second.W_dec[3])
    assert attached(model) == {}


@pytest.mark.parametrize("reads", ["mlp.hook_in", "ln2.hook_normalized"])
def test_a_transcoder_reads_the_mlp_input_and_writes_its_output(model, reads):
    """``mlp.hook_in`` is the MLP module's input (the norm's weight applied); ``ln2.hook_normalized`` the norm's input
    normalised before its weight (TransformerLens's; circuit-tracer's Gemma-2 transcoders read it)."""
    d = model.hidden_size
    g = torch.Generator().manual_seed(4)
    coder = Dictionary.from_tensors(torch.randn(d, FEATURES, generator=g) / d ** 0.5, None,
                                    torch.randn(FEATURES, d, generator=g), None, architecture="transcoder",
                                    hook_name=f"blocks.1.{reads}", hook_name_out="blocks.1.hook_mlp_out")
    seen = {}
    mlp, norm = hf_block(model, 1).mlp, hf_block(model, 1).post_attention_layernorm
    handles = [mlp.register_forward_pre_hook(lambda m, args: seen.setdefault("in", args[0].clone())),
               norm.register_forward_pre_hook(lambda m, args: seen.setdefault("norm_in", args[0].clone())),
               mlp.register_forward_hook(lambda m, args, out: seen.setdefault("out", out.clone()))]
    try:
        with torch.no_grad():
            model._module(**encode(model))
    finally:
        for handle in handles:
            handle.remove()
    with attach(model, coder) as item, torch.no_grad(), model.trace(PROMPTS[0]):
        features = item.features.clone().save()
        item.features[..., 1] += 2.0
        out = model.layers[1].mlp.mlp_output.save()
    if reads == "mlp.hook_in":
        assert torch.equal(features, coder.encode(seen["in"]))
    else:  # an RMSNorm: x / sqrt(mean(x²) + eps), the weight not applied
        x = seen["norm_in"].float()
        normalized = x / (x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
        torch.testing.assert_close(features, coder.encode(normalized.to(x.dtype)), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(normalized, seen["in"], atol=1e-3)  # the two names read different values
    torch.testing.assert_close(out, seen["out"] + 2.0 * coder.W_dec[1], rtol=0, atol=1e-6)


def test_bad_attachments_are_named_before_any_forward(model):
    d = model.hidden_size
    wide = Dictionary.from_tensors(torch.randn(d + 1, 4), None, torch.randn(4, d + 1), None, name="wide")
    with pytest.raises(DictionaryMismatch, match=r"wide has d_in=33, but layers\[1\].layer_output .* is 32 wide"):
        attach(model, wide, "blocks.1.hook_resid_post")
    with pytest.raises(DictionaryMismatch, match=r"runs in torch\.float64, but the model runs"):
        attach(model, _sae(model).to(dtype=torch.float64))
    with pytest.raises(UnknownHookName):
        attach(model, _sae(model, "blocks.1.resid"))
    with pytest.raises(InvalidLayer):
        attach(model, _sae(model, "blocks.9.hook_resid_post"))
    with pytest.raises(DictionaryMismatch, match="not a value per token"):
        attach(model, _sae(model, "blocks.1.attn.hook_pattern"))
    with pytest.raises(DictionaryMismatch, match="names no hook"):
        attach(model, _sae(model, None))
    with pytest.raises(DictionaryMismatch, match="hook_head_index 9 is outside"):
        attach(model, _sae(model), "blocks.1.attn.hook_v", head=9)
    with pytest.raises(ValueNotAvailable):
        attach(model, _sae(model, "blocks.0.attn.hook_q"))  # before rotary: this model does not serve it
    with attach(model, _sae(model)) as item, pytest.raises(NotInTrace, match="outside a trace"):
        item.features.sum()  # a value outside a trace is a placeholder, as every value
    with pytest.raises(NestedTrace, match="Attach before the trace"):
        with model.trace(PROMPTS[0]):
            attach(model, _sae(model))
    assert attached(model) == {}


def test_generate_serves_every_step_and_error_term_false_generates_from_the_reconstruction(model):
    sae = _sae(model)
    steps: list = []
    with attach(model, sae) as item, torch.no_grad(), model.generate(PROMPTS[0], max_new_tokens=3,
                                                                      do_sample=False) as tracer:
        for _ in tracer.iter[0:3]:
            steps.append(item.features.save())
    assert [s.shape[1] for s in steps][1:] == [1, 1]
    hook = hf_block(model, LAYER).register_forward_hook(
        lambda m, args, out: (sae(out[0]), *out[1:]) if isinstance(out, tuple) else sae(out))
    try:
        with torch.no_grad():
            inputs = encode(model)
            reference = model._module.generate(**inputs, max_new_tokens=3, do_sample=False)
    finally:
        hook.remove()
    with attach(model, sae, error_term=False), torch.no_grad(), model.generate(
            PROMPTS[0], max_new_tokens=3, do_sample=False) as tracer:
        output = tracer.result.save()
    assert torch.equal(output, reference)
