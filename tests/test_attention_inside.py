"""Attention's scores, its queries and keys before their norms and its output gate: bad writes get named errors,
the scores under sdpa are recomputed read-only beside the probabilities, and each reads in the model's order."""

from __future__ import annotations

import pytest
import torch

import nncanon
from nncanon.proof.checks.inside import probabilities_of
from nncanon.testing import PROMPTS, tiny_model


@pytest.fixture(scope="module")
def gated():
    return tiny_model("qwen3_next")  # q/k norms, an output gate (eager)


@pytest.mark.parametrize("name", ["attention_scores", "query_states_before_norm", "key_states_before_norm",
                                  "attention_gate"])
def test_a_write_of_the_wrong_shape_names_the_value_and_its_shape(gated, name):
    attention = gated.layers[1].self_attn
    with pytest.raises(nncanon.InvalidWrite, match=rf"layers\[1\]\.self_attn\.{name} .*does not broadcast.*expects "
                                                   r"shape \(1, "):
        with gated.trace(PROMPTS[0]):
            setattr(attention, name, torch.zeros(3, 3))


def test_the_inner_values_read_in_the_models_order(gated):
    attention = gated.layers[1].self_attn
    with torch.no_grad(), gated.trace(PROMPTS[0]):
        before = attention.query_states_before_norm.save()
        keys = attention.key_states_before_norm.save()
        query = attention.query_states.save()
        scores = attention.attention_scores.save()
        probabilities = attention.attention_probabilities.save()
        gate = attention.attention_gate.save()
        heads = attention.attention_head_outputs.save()
    batch, seq = query.shape[:2]
    assert before.shape == query.shape and keys.shape[:2] == (batch, seq)
    assert scores.shape == probabilities.shape == (batch, gated.num_heads, seq, seq)
    assert gate.shape == (batch, seq, heads.shape[-2] * heads.shape[-1])
    torch.testing.assert_close(probabilities_of(scores, attention._module), probabilities)
    with pytest.raises(nncanon.OutOfOrderRead, match=r"attention_scores was read, after .*attention_probabilities"):
        with torch.no_grad(), gated.trace(PROMPTS[0]):
            attention.attention_probabilities.save()
            attention.attention_scores.save()


def test_a_norm_input_written_is_what_the_norm_receives(gated):
    attention = gated.layers[1].self_attn
    module = attention._module.q_norm
    normed = []  # the norm's output: an RMS norm of zeros is zeros
    handle = module.register_forward_hook(lambda mod, args, output: normed.append(output.clone()))
    try:
        with torch.no_grad(), gated.trace(PROMPTS[0]):
            attention.query_states_before_norm[:, -1] = 0
    finally:
        handle.remove()
    assert not normed[0][:, -1].any() and normed[0][:, 0].any()


def test_under_sdpa_the_scores_are_recomputed_read_only_beside_the_probabilities():
    model = tiny_model("llama", attn_implementation="sdpa")
    attention = model.layers[0].self_attn
    for first, second in (("attention_scores", "attention_probabilities"),
                          ("attention_probabilities", "attention_scores")):
        saved = {}
        with torch.no_grad(), model.trace(PROMPTS):
            saved[first] = getattr(attention, first).save()
            saved[second] = getattr(attention, second).save()
        torch.testing.assert_close(saved["attention_scores"].softmax(-1), saved["attention_probabilities"])
    with pytest.raises(nncanon.InvalidWrite, match=r"attention_scores was written .*attn_implementation=\"eager\""):
        with model.trace(PROMPTS[0]):
            attention.attention_scores[:, 0] = 0
    with pytest.raises(nncanon.InvalidWrite, match=r"attention_scores was written .*attn_implementation=\"eager\""):
        with model.trace(PROMPTS[0]):
            attention.attention_scores = torch.zeros(1)
    assert "recomputed beside the kernel" in model.support().gradient_reason("attention_scores", layer=0)
    eager = tiny_model("llama")
    assert eager.support().gradient_reason("attention_scores", layer=0) is None


def test_the_scores_gradient_is_the_probabilities_gradient_through_the_softmax():
    model = tiny_model("llama")
    attention = model.layers[0].self_attn
    with model.trace(PROMPTS[0]):
        scores = attention.attention_scores.save()
        probabilities = attention.attention_probabilities.save()
        logit = model.logits[0, -1, 5]
        with logit.backward():
            grad_probabilities = probabilities.grad.save()
            grad_scores = scores.grad.save()
    p = probabilities.detach()
    expected = p * (grad_probabilities - (grad_probabilities * p).sum(-1, keepdim=True))  # softmax's backward
    torch.testing.assert_close(grad_scores, expected, rtol=1e-5, atol=1e-7)
