"""The attention kernel's inputs (``query_states``, ``key_states``, ``value_states``) and the probabilities
recomputed from them under sdpa: layout, writes, what is computed, and the named refusals.

(That they equal the kernel's inputs, reproduce the probabilities, and that the recomputed probabilities
equal eager's on every family, is proved by the ``read``, ``kernel`` and ``recomputed`` checks of the
verifier, run on every registered variant by tests/families.)
"""

from __future__ import annotations

import pytest
import torch

import nncanon
from nncanon.components import kernel
from nncanon.testing import PROMPTS, tiny_model


@pytest.fixture(scope="module")
def sdpa():
    return tiny_model("llama", attn_implementation="sdpa")


def test_kernel_inputs_are_sequence_first_views_of_the_interface_call(sdpa):
    attention = sdpa.layers[1].self_attn
    with torch.no_grad(), sdpa.trace(PROMPTS):
        q, k, v = attention.query_states.save(), attention.key_states.save(), attention.value_states.save()
        call = attention.source.attention_interface_1.inputs.save()
    args, _ = call
    batch, seq = sdpa.tokenizer(PROMPTS, return_tensors="pt", padding=True)["input_ids"].shape
    assert q.shape == (batch, seq, sdpa.num_heads, sdpa.head_dim)
    assert k.shape == v.shape == (batch, seq, sdpa.num_kv_heads, sdpa.head_dim)
    for served, raw in zip((q, k, v), args[1:4], strict=True):
        assert served.data_ptr() == raw.data_ptr() and torch.equal(served, raw.transpose(1, 2))


def test_a_soft_capped_call_under_sdpa_is_not_recomputed(sdpa):
    """sdpa ignores a soft-cap (transformers 5.20 lets Gemma-2 run it; 5.21+ refuse it, and 5.24's sdpa raises):
    eager's soft-capped probabilities are not the kernel's, so the recomputation refuses naming the soft-cap."""
    attention = sdpa.layers[1].self_attn
    with torch.no_grad(), sdpa.trace(PROMPTS[0]):
        call = attention.source.attention_interface_1.inputs.save()
    args, kwargs = call
    assert kernel.recompute_probabilities(attention._module, args, kwargs).shape[-2:] == (args[1].shape[-2],) * 2
    with pytest.raises(nncanon.ValueNotAvailable, match=r"softcap=50.0\), and the 'sdpa' kernel ignores the soft-cap"):
        kernel.recompute_probabilities(attention._module, args, {**kwargs, "softcap": 50.0})


def test_kernel_input_assignment_reaches_the_kernel_and_is_checked(sdpa):
    attention = sdpa.layers[0].self_attn
    with torch.no_grad(), sdpa.trace(PROMPTS[0]):
        keys = attention.key_states
        attention.key_states = torch.zeros_like(keys)      # every score 0: uniform causal attention
        values = attention.value_states.save()
        outputs = attention.attention_head_outputs.save()
    uniform = values.cumsum(1) / torch.arange(1, values.shape[1] + 1)[None, :, None, None]
    groups = sdpa.num_heads // sdpa.num_kv_heads
    torch.testing.assert_close(outputs, uniform.repeat_interleave(groups, dim=-2), rtol=1e-5, atol=1e-6)
    with pytest.raises(nncanon.InvalidWrite, match=r"layers\[0\]\.self_attn\.query_states.*expects shape"):
        with sdpa.trace(PROMPTS[0]):
            attention.query_states = torch.zeros(3)


def test_probabilities_are_recomputed_for_the_layers_read_only(sdpa, monkeypatch):
    calls = []
    original = kernel._eager_function

    def counting(cls):
        function = original(cls)

        def counted(module, *args, **kwargs):
            calls.append(module.layer_idx)
            return function(module, *args, **kwargs)

        return counted

    monkeypatch.setattr(kernel, "_eager_function", counting)
    with torch.no_grad(), sdpa.trace(PROMPTS[0]):
        sdpa.layers[1].self_attn.attention_probabilities.save()
        sdpa.logits.save()
    assert calls == [1]


def test_probability_writes_under_sdpa_are_refused_naming_eager(sdpa):
    attention = sdpa.layers[0].self_attn
    with pytest.raises(nncanon.InvalidWrite, match='attn_implementation="eager"'):
        with torch.no_grad(), sdpa.trace(PROMPTS[0]):
            attention.attention_probabilities[:, 0] = 0
    with pytest.raises(nncanon.InvalidWrite, match='attn_implementation="eager"'):
        with torch.no_grad(), sdpa.trace(PROMPTS[0]):
            attention.attention_probabilities = torch.zeros(1)
    with torch.no_grad(), sdpa.trace(PROMPTS[0]):             # a read alone is no write
        probabilities = attention.attention_probabilities.save()
        logits = sdpa.logits.save()
    assert torch.allclose(probabilities.sum(-1), torch.ones(()))
    with torch.no_grad():
        plain = sdpa._module(**sdpa.tokenizer(PROMPTS[0], return_tensors="pt")).logits
    assert torch.equal(logits, plain)


def test_other_implementations_decline_recomputation_naming_eager():
    model = tiny_model("llama", attn_implementation="sdpa")
    model._module.config._attn_implementation = "flex_attention"   # read at each call (no forward is run)
    report = model.support()
    reason = report.reason("attention_probabilities", layer=0)
    assert "'sdpa'" in reason and 'attn_implementation="eager"' in reason
    assert report.available("query_states", layer=0)
    with pytest.raises(nncanon.ValueNotAvailable, match="flex_attention"):
        with model.trace(PROMPTS[0]):
            model.layers[0].self_attn.attention_probabilities


def test_a_proof_that_fails_recomputation_declines_it_with_the_reason(monkeypatch):
    """A twin whose recomputed probabilities do not hold: the loaded sdpa model declines them, naming eager."""
    from nncanon.proof import checks
    from nncanon.proof import verdict as verdicts
    from nncanon.testing import tiny_hf_model, tiny_tokenizer

    def wrong(model):
        return [checks.CheckResult("recomputed", index, (kernel.RECOMPUTED,), False, 0.5, 1e-5, "made to fail")
                for index in range(model.num_layers)]

    replaced = tuple(checks.Check(c.name, wrong if c.name == "recomputed" else c.run, c.doc)
                     for c in verdicts.CHECKS)
    monkeypatch.setattr(verdicts, "CHECKS", replaced)
    model = nncanon.StandardizedTransformer(tiny_hf_model("llama", attn_implementation="sdpa"),
                                            tokenizer=tiny_tokenizer(), verify="always")
    report = model.support()
    reason = report.reason("attention_probabilities", layer=0)
    assert "made to fail" in reason and 'attn_implementation="eager"' in reason
    assert report.available("query_states", layer=0) and report.available("attention_head_outputs", layer=0)


def test_generation_steps_see_the_cached_keys():
    model = tiny_model("llama")
    attention = model.layers[0].self_attn
    shapes = []
    with torch.no_grad(), model.generate(PROMPTS[0], max_new_tokens=3, do_sample=False) as tracer:
        for _ in tracer.iter[:3]:
            shapes.append(tuple(attention.key_states.shape))
    prompt = len(model.tokenizer(PROMPTS[0])["input_ids"])
    assert [shape[1] for shape in shapes] == [prompt, prompt + 1, prompt + 2]
