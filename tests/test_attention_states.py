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
from nncanon.versions import transformers_minor


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


def _gradients(model, names: tuple[str, ...], layer: int = 1) -> dict[str, torch.Tensor]:
    """``value.grad`` of each of ``names`` on block ``layer`` for one logit, through nncanon."""
    from nncanon.proof.checks.base import NO_CACHE
    from nncanon.proof.checks.gradient_references import gradient_target

    values: dict = {}  # bound outside the trace, filled inside
    grads: dict = {}
    with torch.enable_grad(), model.trace(PROMPTS[0], **NO_CACHE):
        for name in names:
            values[name] = getattr(model.layers[layer].self_attn, name)
        logit = model.logits[gradient_target(model)]
        with logit.backward():
            for name in reversed(names):
                grads[name] = values[name].grad.save()
    return grads


OTHERS = ("query_states", "key_states", "value_states", "attention_output")


@pytest.mark.parametrize(
    "family", ["gpt2", "llama", "qwen2", "mistral", "gemma3_text", "falcon_7b_style", "falcon_40b_style"])
def test_probability_gradients_under_sdpa_are_eagers(family):
    """Under sdpa the recomputed probabilities are put into the graph at the kernel's output: their ``.grad``
    equals eager's (same weights), whose ``.grad`` is plain PyTorch's gradient at the tensor the model returns
    (the verifier's `gradient_reference`); the other values' gradients are bit for bit those of a trace that
    does not read the probabilities, and the logits are unchanged."""
    from nncanon.proof.checks.gradient_references import gradient_inputs, gradient_reference, gradient_target

    eager = tiny_model(family)
    sdpa = tiny_model(family, attn_implementation="sdpa")
    assert sdpa.layers[1].self_attn._module.config._attn_implementation == "sdpa"
    sdpa._module.load_state_dict(eager._module.state_dict())
    target = gradient_target(eager)
    reference = gradient_reference(eager, 1, ["attention_probabilities"], gradient_inputs(eager),
                                   lambda logits: logits[target])["attention_probabilities"]
    assert float(reference.abs().max()) > 0
    ours = _gradients(eager, ("attention_probabilities",))["attention_probabilities"]
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-7)

    served = _gradients(sdpa, (*OTHERS[:3], "attention_probabilities", OTHERS[3]))
    torch.testing.assert_close(served["attention_probabilities"], ours, rtol=0, atol=1e-6)
    alone = _gradients(sdpa, OTHERS)
    for name in OTHERS:
        assert torch.equal(served[name], alone[name]), name
    assert sdpa.support().gradient_reason("attention_probabilities", 1) is None


def test_the_verifiers_gradient_check_covers_the_recomputed_probabilities(sdpa):
    """The ``gradients`` check compares the sdpa probabilities' ``.grad`` with eager's on a copy (same weights)."""
    from nncanon.proof.checks.gradients import check_gradients

    results = check_gradients(sdpa)
    probabilities = [r for r in results if r.values == ("attention_probabilities",)]
    assert [r.layer for r in probabilities] == list(range(sdpa.num_layers))
    assert all(r.passed for r in results), [r for r in results if not r.passed]


def test_probability_logits_and_parameter_gradients_under_sdpa_are_unchanged_bit_for_bit(sdpa):
    """Reading the probabilities with gradients tracked hands the model the kernel's output bit for bit, and
    adds no gradient anywhere in the model (the parameters' gradients are those of the plain model)."""
    from nncanon.proof.checks.base import NO_CACHE
    from nncanon.proof.checks.gradient_references import gradient_target

    target = gradient_target(sdpa)
    parameters = [p for p in sdpa._module.parameters() if p.requires_grad]
    runs = []
    for read in (False, True):
        with torch.enable_grad(), sdpa.trace(PROMPTS[0], **NO_CACHE):
            if read:
                sdpa.layers[1].self_attn.attention_probabilities.save()
            logits = sdpa.logits.save()
        runs.append((logits, torch.autograd.grad(logits[target], parameters)))
    assert torch.equal(runs[0][0], runs[1][0])
    for plain, read in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(plain, read)


def test_probability_gradient_writes_under_sdpa_are_refused_naming_eager(sdpa):
    from nncanon.proof.checks.base import NO_CACHE
    from nncanon.proof.checks.gradient_references import gradient_target

    refused = r"attention_probabilities\.grad was written.*attn_implementation=\"eager\""
    with pytest.raises(nncanon.InvalidWrite, match=refused):
        with torch.enable_grad(), sdpa.trace(PROMPTS[0], **NO_CACHE):
            probabilities = sdpa.layers[1].self_attn.attention_probabilities
            logit = sdpa.logits[gradient_target(sdpa)]
            with logit.backward():
                probabilities.grad = torch.zeros_like(probabilities.grad)


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
    from nncanon.proof import verdict as verdicts
    from nncanon.proof.checks.base import Check, CheckResult
    from nncanon.testing import tiny_hf_model, tiny_tokenizer

    def wrong(model):
        return [CheckResult("recomputed", index, (kernel.RECOMPUTED,), False, 0.5, 1e-5, "made to fail")
                for index in range(model.num_layers)]

    replaced = tuple(Check(c.name, wrong if c.name == "recomputed" else c.run, c.doc)
                     for c in verdicts.CHECKS)
    monkeypatch.setattr(verdicts, "CHECKS", replaced)
    model = nncanon.StandardizedTransformer(tiny_hf_model("llama", attn_implementation="sdpa"),
                                            tokenizer=tiny_tokenizer(), verify="always")
    report = model.support()
    reason = report.reason("attention_probabilities", layer=0)
    assert "made to fail" in reason and 'attn_implementation="eager"' in reason
    assert report.available("query_states", layer=0) and report.available("attention_head_outputs", layer=0)


def _cached_key_shapes(model) -> list[tuple[int, ...]]:
    """``layers[0].self_attn.key_states``' shape at each of three generation steps; asserts the key axis grows
    by one token a step from the prompt's length (the keys the kernel sees include the cache)."""
    attention = model.layers[0].self_attn
    shapes = []
    with torch.no_grad(), model.generate(PROMPTS[0], max_new_tokens=3, do_sample=False) as tracer:
        for _ in tracer.iter[:3]:
            shapes.append(tuple(attention.key_states.shape))
    prompt = len(model.tokenizer(PROMPTS[0])["input_ids"])
    assert [shape[1] for shape in shapes] == [prompt, prompt + 1, prompt + 2]
    return shapes


def test_generation_steps_see_the_cached_keys():
    _cached_key_shapes(tiny_model("llama"))


# -- attention written inline: the family names its kernel call (`Family.kernel`) --------------------------


#: Falcon before transformers 5.25 attends inline and calls sdpa itself under sdpa only; from 5.25 it goes through
#: transformers' attention interface (covered there by the interface tests here and by tests/families).
_FALCON_INLINE = pytest.mark.skipif(transformers_minor() >= (5, 25), reason=(
    "transformers 5.25 moved Falcon's attention onto the attention interface: no sdpa call of its own"))


@pytest.fixture(scope="module")
def falcon_sdpa():
    return tiny_model("falcon_7b_style", attn_implementation="sdpa")


@_FALCON_INLINE
def test_falcon_under_sdpa_serves_the_sdpa_call_inputs_and_recomputes_probabilities(falcon_sdpa):
    model = falcon_sdpa
    attention = model.layers[1].self_attn
    with torch.no_grad(), model.trace(PROMPTS):
        q, k, v = attention.query_states.save(), attention.key_states.save(), attention.value_states.save()
        call = attention.source.torch_nn_functional_scaled_dot_product_attention_0.inputs.save()
        probabilities = attention.attention_probabilities.save()
        output = attention.source.torch_nn_functional_scaled_dot_product_attention_0.output.save()
    args, _ = call
    for served, raw in zip((q, k, v), args[:3], strict=True):
        assert served.data_ptr() == raw.data_ptr() and torch.equal(served, raw.transpose(1, 2))
    assert k.shape[-2] == 1  # multi-query: one key/value head, shared by every query head
    real = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)["attention_mask"].bool()
    torch.testing.assert_close((probabilities @ args[2]).transpose(1, 2)[real], output.transpose(1, 2)[real],
                               rtol=1e-5, atol=1e-6)


def test_falcon_kernel_writes_reach_the_sdpa_call(falcon_sdpa):
    model = falcon_sdpa
    attention = model.layers[0].self_attn
    with torch.no_grad(), model.trace(PROMPTS[0]):
        attention.key_states = torch.zeros_like(attention.key_states)  # every score 0: uniform causal attention
        values = attention.value_states.save()
        outputs = attention.attention_head_outputs.save()
    uniform = values.cumsum(1) / torch.arange(1, values.shape[1] + 1)[None, :, None, None]
    torch.testing.assert_close(outputs, uniform.expand_as(outputs), rtol=1e-5, atol=1e-6)


@_FALCON_INLINE
def test_falcon_under_eager_declines_the_kernel_inputs_naming_sdpa():
    model = tiny_model("falcon_7b_style")  # eager: the forward multiplies q, k, v inline, no call takes them
    reason = model.support().reason("query_states", layer=0)
    assert "attn_implementation='sdpa'" in reason
    assert model.support().available("attention_probabilities", layer=0)
    with pytest.raises(nncanon.ValueNotAvailable, match="sdpa"):
        with model.trace(PROMPTS[0]):
            model.layers[0].self_attn.query_states


@_FALCON_INLINE
def test_falcon_alibi_under_sdpa_declines_recomputed_probabilities_naming_eager():
    model = tiny_model("falcon_rw_style", attn_implementation="sdpa")
    report = model.support()
    assert report.available("query_states", layer=0) and report.available("value_states", layer=0)
    assert "ALiBi" in report.reason("attention_probabilities", layer=0)
    assert 'attn_implementation="eager"' in report.reason("attention_probabilities", layer=0)


def test_heads_folded_into_the_batch_are_served_as_views_per_invoke():
    """XGLM's kernel takes ``[b·H, s, d]`` tensors (the key transposed): each invoke reads its own rows, a view
    of the kernel's tensor, and a write in one invoke reaches its rows only."""
    model = tiny_model("xglm")
    attention = model.layers[0].self_attn
    heads = model.num_heads
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            clean_q = attention.query_states.save()
            clean_logits = model.logits.save()
        with tracer.invoke(PROMPTS[0]):
            call = attention.source.torch_bmm_0.inputs.save()
            keys = attention.key_states.save()
            attention.query_states[:] = 0                      # every score 0: uniform causal attention
            values = attention.value_states.save()
            outputs = attention.attention_head_outputs.save()
            written_logits = model.logits.save()
    args, _ = call
    seq = clean_q.shape[1]
    assert clean_q.shape == (1, seq, heads, model.head_dim)
    assert torch.equal(keys, args[1].unflatten(0, (2, heads))[1:].permute(0, 3, 1, 2))  # [b, s, H, d]
    assert torch.equal(args[0].unflatten(0, (2, heads))[0], clean_q[0].transpose(0, 1))  # invoke 1: untouched
    assert not args[0].unflatten(0, (2, heads))[1].any()                                # invoke 2: zeroed
    uniform = values.cumsum(1) / torch.arange(1, seq + 1)[None, :, None, None]
    torch.testing.assert_close(outputs, uniform, rtol=1e-5, atol=1e-6)
    assert torch.equal(clean_logits, model._module(**model.tokenizer(PROMPTS[0], return_tensors="pt")).logits)
    assert not torch.equal(written_logits, clean_logits)


def test_a_transposed_key_is_served_sequence_first():
    """GPT-1 passes its key ``[b, H, d, s]`` to ``_attn``: served ``[b, s, H, d]``, a view."""
    model = tiny_model("openai_gpt")
    attention = model.layers[0].self_attn
    with torch.no_grad(), model.trace(PROMPTS[0]):
        keys = attention.key_states.save()
        call = attention.source.self__attn_0.inputs.save()
    raw = call[0][1]
    assert keys.shape == (1, raw.shape[-1], model.num_heads, model.head_dim)
    assert keys.data_ptr() == raw.data_ptr() and torch.equal(keys, raw.permute(0, 3, 1, 2))


@pytest.mark.parametrize("name", ["bloom", "mpt", "gpt_neo"])
def test_inline_generation_steps_see_the_cached_keys(name):
    model = tiny_model(name)
    shapes = _cached_key_shapes(model)
    assert {shape[2:] for shape in shapes} == {(model.num_heads, model.head_dim)}


@pytest.mark.parametrize("name, implementation", [("llama", "eager"), ("llama", "sdpa"), ("bloom", "eager")])
def test_an_in_place_write_to_the_keys_and_values_reaches_that_steps_kernel_not_the_cache(name, implementation):
    """The keys and values the kernel receives are the cache's own tensors (transformers' ``update`` returns
    its storage): an in-place write at step 0 reaches that step's kernel, and step 1 sees the cache a clean
    run left."""
    model = tiny_model(name, attn_implementation=implementation)
    attention = model.layers[0].self_attn
    options = {"max_new_tokens": 2, "min_new_tokens": 2, "do_sample": False}
    clean, written = [], []
    with torch.no_grad(), model.generate(PROMPTS[0], **options) as tracer:
        for _ in tracer.iter[0:2]:
            clean.append((attention.key_states.clone().save(), attention.value_states.clone().save()))
    with torch.no_grad(), model.generate(PROMPTS[0], **options) as tracer:
        for step in tracer.iter[0:2]:
            keys, values = attention.key_states, attention.value_states
            if step == 0:
                keys[:, :, 0] = 1.0
                values[:] = 0
                zeroed = attention.attention_head_outputs.save()   # every head attends to zero values
            written.append((keys.clone().save(), values.clone().save()))
    prompt = clean[0][0].shape[1]
    assert not zeroed.any() and not written[0][1].any()
    assert torch.equal(written[1][0][:, :prompt], clean[1][0][:, :prompt])  # the cache kept the model's keys
    assert torch.equal(written[1][1][:, :prompt], clean[1][1][:, :prompt])  # and values
