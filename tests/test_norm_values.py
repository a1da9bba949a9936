"""The norm values' edges: bad writes (a scale of the wrong shape, not positive, not finite) raise `InvalidWrite`
naming the value and the expected shape; a family without a norm says why; writes stay in their invoke; a scale's
and a normalised value's ``.grad`` arrive; the names resolve."""

from __future__ import annotations

import pytest
import torch

import nncanon
from nncanon.sae import resolve, value_at
from nncanon.testing import PROMPTS, tiny_model

from .conftest import skip_unavailable


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_a_scale_of_the_wrong_shape_is_refused(llama):
    attention = llama.layers[0].self_attn
    with pytest.raises(nncanon.InvalidWrite, match=r"layers\[0\]\.self_attn\.attention_norm_scale.*expects shape"):
        with llama.trace(PROMPTS[0]):
            attention.attention_norm_scale = torch.ones(3, 2)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_scale_not_positive_and_finite_is_refused(llama, bad):
    attention = llama.layers[0].self_attn
    with pytest.raises(nncanon.InvalidWrite, match=r"attention_norm_scale.*positive, finite"):
        with llama.trace(PROMPTS[0]):
            scale = attention.attention_norm_scale
            attention.attention_norm_scale = torch.full_like(scale, bad)
    with pytest.raises(nncanon.InvalidWrite, match=r"layers\[0\]\.mlp\.mlp_norm_scale.*positive, finite.*shape \(1, "):
        with llama.trace(PROMPTS[0]):  # an edit in place is checked when it goes back to the model
            llama.layers[0].mlp.mlp_norm_scale[:, -1] = bad
            llama.logits.save()


def test_nothing_moves_the_next_clean_trace(llama):
    with torch.no_grad(), llama.trace(PROMPTS[0]):
        clean = llama.logits.save()
    with torch.no_grad(), llama.trace(PROMPTS[0]):
        llama.layers[1].self_attn.attention_normalized[:, 2] = 0
        llama.final_norm_scale[:, -1] *= 3
    with torch.no_grad(), llama.trace(PROMPTS[0]):
        again = llama.logits.save()
    assert torch.equal(clean, again)


def test_a_write_stays_in_its_invoke(llama):
    with torch.no_grad(), llama.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            first = llama.logits.save()
        with tracer.invoke(PROMPTS[0]):
            llama.layers[0].mlp.mlp_norm_scale[:] = llama.layers[0].mlp.mlp_norm_scale * 2
            second = llama.logits.save()
    assert not torch.equal(first, second)
    with torch.no_grad(), llama.trace(PROMPTS[0]):
        alone = llama.logits.save()
    assert torch.equal(first, alone)


def test_normalized_write_makes_the_output_written_times_weight(llama):
    norm = llama._module.model.layers[0].input_layernorm
    with torch.no_grad(), llama.trace(PROMPTS[0]):
        llama.layers[0].self_attn.attention_normalized[:, -1] = 1.0
        received = llama.layers[0].self_attn.attention_input.save()
    torch.testing.assert_close(received[0, -1], norm.weight.detach(), rtol=0, atol=0)


def test_frozen_scale_from_another_prompt(llama):
    """Freezing: the clean run's scales written into a run on another prompt make the norm divide by them."""
    with torch.no_grad(), llama.trace(PROMPTS[0]):
        clean = llama.final_norm_scale.save()
        normalized = llama.final_normalized.save()
    with torch.no_grad(), llama.trace(PROMPTS[0]):
        llama.final_norm_scale = clean  # the same prompt: nothing moves
        same = llama.final_normalized.save()
    assert torch.equal(same, normalized)


def test_gradients_arrive(llama):
    with llama.trace(PROMPTS[0]):
        scale = llama.layers[0].self_attn.attention_norm_scale
        normalized = llama.layers[1].mlp.mlp_normalized
        logit = llama.logits[0, -1, 5]
        with logit.backward():  # (in the reverse of the forward order)
            normalized_grad = normalized.grad.save()
            scale_grad = scale.grad.save()
    assert scale_grad.shape[-1] == 1 and normalized_grad.shape[-1] == llama.hidden_size
    assert scale_grad.abs().sum() > 0 and normalized_grad.abs().sum() > 0


def test_a_family_without_the_norm_says_why(llama):
    with pytest.raises(nncanon.ValueNotAvailable, match="no post-norm"):
        with llama.trace(PROMPTS[0]):
            llama.layers[0].self_attn.attention_post_norm_scale.save()
    with pytest.raises(nncanon.ValueNotAvailable, match="no query norm"):
        resolve(llama, "layers.0.query_norm_scale")


def test_parallel_block_declines_the_mlp_norm():
    gptj = tiny_model("gptj")
    with pytest.raises(nncanon.ValueNotAvailable, match="parallel block: one norm feeds both"):
        resolve(gptj, "blocks.0.ln2.hook_scale")
    assert resolve(gptj, "blocks.0.ln1.hook_scale").value == "attention_norm_scale"


def test_names_resolve_and_read(llama):
    assert resolve(llama, "blocks.1.ln2.hook_scale").value == "mlp_norm_scale"
    assert resolve(llama, "ln_final.hook_scale").label == "model.final_norm_scale"
    assert resolve(llama, "layers.1.attention_normalized").value == "attention_normalized"
    with torch.no_grad(), llama.trace(PROMPTS[0]):
        by_name = value_at(llama, "blocks.1.ln1.hook_scale").save()
        final = value_at(llama, "ln_final.hook_scale").save()
        direct = llama.final_norm_scale.save()
    assert by_name.shape[-1] == 1 and torch.equal(final, direct)


def test_heads_first_query_norm_is_served_sequence_first():
    """Gemma-3 norms its queries heads-first (``[b, H, s, hd]``): ``query_norm_scale`` is ``[b, s, H, 1]``, the
    denominator a plain hook on ``q_norm`` computes, transposed; its ``.grad`` arrives in the same layout; a write
    at one position and head changes only that entry of the norm's output."""
    gemma = tiny_model("gemma3_text")
    norm = gemma._module.model.layers[0].self_attn.q_norm
    seen = []
    handle = norm.register_forward_hook(lambda mod, args, out: seen.append((args[0].detach(), out.detach())))
    try:
        with gemma.trace(PROMPTS[0]):
            scale = gemma.layers[0].self_attn.query_norm_scale
            saved = scale.save()
            logit = gemma.logits[0, -1, 5]
            with logit.backward():
                grad = scale.grad.save()
        x, clean = seen[0]
        seen.clear()
        with torch.no_grad(), gemma.trace(PROMPTS[0]):
            gemma.layers[0].self_attn.query_norm_scale[0, -1, 1] = saved[0, -1, 1] * 2
    finally:
        handle.remove()
    b, heads, s, _ = x.shape
    expected = (x.float().pow(2).mean(-1, keepdim=True) + norm.eps).sqrt().transpose(1, 2)
    assert saved.shape == grad.shape == (b, s, heads, 1) and grad.abs().sum() > 0
    torch.testing.assert_close(saved, expected, rtol=1e-6, atol=1e-6)
    changed = (seen[0][1] != clean).any(-1)  # [b, H, s]
    assert changed[0, 1, -1] and int(changed.sum()) == 1


def test_gemma3n_default_config_norm_gradients_hold():
    """Gemma-3n's default config (transformers' ``Gemma3nTextConfig()``), on the twin its proof runs on: every norm
    value's ``.grad`` is proved. (A scale's gradient sums g·N/scale over the head dimension, and the g it sums,
    from the model's backward through full attention, AltUp and laurel, carries its own rounding, which its
    difference from plain PyTorch is measured against as the normalised value's is: a key norm's scale was 1.8e-4
    apart, relative to its terms alone, with plain PyTorch itself 1.1e-4 from float64.)"""
    skip_unavailable("gemma3n_text")
    from transformers import Gemma3nTextConfig

    from nncanon.families import family_for
    from nncanon.proof.checks.norms import check_norm_gradients
    from nncanon.proof.ladder import running_twin
    from nncanon.proof.load import mounted_twin

    config = Gemma3nTextConfig()
    family = family_for(config)
    twin = mounted_twin(running_twin(config, blocks=family.layers).twin.model, family)
    results = check_norm_gradients(twin)
    assert {r.values[0] for r in results} >= {"key_norm_scale", "query_norm_scale", "mlp_norm_scale"}
    assert [r.describe() for r in results if not r.passed] == []


def test_a_linear_mixers_post_norm_is_served():
    """LFM3's convolution blocks norm the mixer's output (``post_operator_norm``) before adding it, as its attention
    blocks do: ``linear_attention_post_norm_scale`` is served there (``ln1_post.hook_scale``), the denominator a plain
    hook on the norm computes; ``attention_post_norm_scale`` on its attention blocks."""
    skip_unavailable("lfm3")
    lfm3 = tiny_model("lfm3")
    kinds = lfm3.config.layer_types
    conv, attention = kinds.index("conv"), next(i for i, kind in enumerate(kinds) if kind != "conv")
    assert resolve(lfm3, f"blocks.{conv}.ln1_post.hook_scale").value == "linear_attention_post_norm_scale"
    assert resolve(lfm3, f"blocks.{attention}.ln1_post.hook_scale").value == "attention_post_norm_scale"
    norm = lfm3._module.model.layers[conv].post_operator_norm
    seen = []
    handle = norm.register_forward_hook(lambda mod, args, out: seen.append(args[0].detach()))
    try:
        with torch.no_grad(), lfm3.trace(PROMPTS[0]):
            scale = lfm3.layers[conv].linear_attn.linear_attention_post_norm_scale.save()
    finally:
        handle.remove()
    torch.testing.assert_close(scale, (seen[0].float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt())


def test_a_failed_final_norm_gradient_declines_its_grad_only(monkeypatch, tmp_path):
    """The final norm's gradient check forced to fail (the plain reference of ``final_norm_scale``'s gradient
    doubled): the load declines ``model.final_norm_scale.grad`` with the check's numbers, as a block value's is; the
    value itself and every other norm value's ``.grad`` stay served."""
    from nncanon import StandardizedTransformer
    from nncanon.proof.checks import norms as norm_checks
    from nncanon.testing import tiny_hf_model, tiny_tokenizer

    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    plain = norm_checks._plain_gradients

    def doubled(*args, **kwargs):
        gradients, terms = plain(*args, **kwargs)
        gradients[None, "final_norm_scale"] = gradients[None, "final_norm_scale"] * 2
        return gradients, terms

    monkeypatch.setattr(norm_checks, "_plain_gradients", doubled)
    model = StandardizedTransformer(tiny_hf_model("llama"), tokenizer=tiny_tokenizer(), verify="always")
    monkeypatch.setattr(norm_checks, "_plain_gradients", plain)
    report = model.support()
    reason = report.gradient_reason("final_norm_scale")
    assert "norm_gradients on the model (final_norm_scale): failed, error" in reason, reason
    assert report.reason("final_norm_scale") is None and report.gradient_reason("final_normalized") is None
    assert report.gradient_reason("attention_norm_scale", 0) is None
    with torch.no_grad(), model.trace(PROMPTS[0]):
        scale = model.final_norm_scale.save()
    assert scale.shape[-1] == 1
    with pytest.raises(nncanon.GradientNotAvailable, match=r"final_norm_scale\.grad is not served: .*norm_gradients"):
        with model.trace(PROMPTS[0]):
            value = model.final_norm_scale
            logit = model.logits[0, -1, 5]
            with logit.backward():
                value.grad.save()
