"""The edges of wave 2 (issue 25): stale probabilities, writes that do nothing, a config changed after its proof,
non-finite steering, and the bare errors left. (The proof cache's points: tests/test_edges_cache.py.)

Each test asserts an exact named error and its message, or an equality between independent computations; every
refusal leaves the model as it was: the next trace's logits are bit-identical to a clean one's.
"""

from __future__ import annotations

import re

import pytest
import torch

import nncanon
from nncanon import (
    ConfigChanged,
    GradientNotAvailable,
    InvalidArgument,
    InvalidCheckpoint,
    InvalidInput,
    InvalidModel,
    InvalidWrite,
    NestedTrace,
    NotInTrace,
    OutOfOrderRead,
    StandardizedTransformer,
    TokenizerNotFound,
    ValueNotAvailable,
    tools,
)
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_model, tiny_tokenizer
from nncanon.tools import logit_difference, steer


@pytest.fixture(scope="module")
def sdpa():
    return tiny_model("llama", attn_implementation="sdpa")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", num_hidden_layers=4)


def _logits(model, prompt=PROMPTS[0]):
    with torch.no_grad(), model.trace(prompt):
        logits = model.logits.save()
    return logits


# -- 1. a kernel input written after the probabilities it made were read -------------------------------------------


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("write", ["key_states", "query_states", "value_states"])
def test_a_kernel_input_written_after_the_probabilities_is_out_of_order(implementation, write):
    """Was silent under sdpa in a ``no_grad`` trace: the write reached the kernel, the saved probabilities were those
    of the unwritten keys. One rule now, under every implementation and with or without gradients: the probabilities
    come after the call's inputs."""
    model = tiny_model("llama", attn_implementation=implementation)
    attention = model.layers[0].self_attn
    clean = _logits(model)
    for grad in (False, True):
        with pytest.raises(OutOfOrderRead, match=rf"layers\[0\]\.self_attn\.{write} was read, after "
                           r"layers\[0\]\.self_attn\.attention_probabilities,"):
            with torch.set_grad_enabled(grad), model.trace(PROMPTS[0]):
                attention.attention_probabilities.save()
                getattr(attention, write)[:] = 0
    assert torch.equal(_logits(model), clean)


def test_probabilities_read_after_a_key_write_are_those_of_the_written_keys(sdpa):
    """The order that works: keys zeroed first, then the probabilities are those of zero keys (every score 0): each
    query spreads evenly over the positions it may attend, as a causal mask computed here says."""
    attention = sdpa.layers[0].self_attn
    with torch.no_grad(), sdpa.trace(PROMPTS[0]):
        attention.key_states[:] = 0
        probabilities = attention.attention_probabilities.save()
    positions = probabilities.shape[-1]
    causal = torch.ones(positions, positions).tril()
    assert torch.allclose(probabilities[0], (causal / causal.sum(-1, keepdim=True)).expand_as(probabilities[0]),
                          atol=1e-6)


# -- 2. read-only probabilities and their gradient, through any view ---------------------------------------------------


@pytest.mark.parametrize("edit", [
    lambda p: p.data.zero_(),
    lambda p: p.detach().zero_(),
    lambda p: p.numpy().fill(0),
    lambda p: p.view(-1)[0:1].data.fill_(0.5),
], ids=[".data", ".detach()", ".numpy()", "a view's .data"])
def test_an_edit_of_read_only_probabilities_through_any_view_is_refused(sdpa, edit):
    """Was neither refused nor effective (``p.data.zero_()``: the logits did not change)."""
    clean = _logits(sdpa)
    with pytest.raises(InvalidWrite, match=r"attention_probabilities was written \(by assignment, in place, or "
                       r"through a view such as \.data\), but this model does not run eager attention"):
        with torch.no_grad(), sdpa.trace(PROMPTS[0]):
            edit(sdpa.layers[0].self_attn.attention_probabilities)
            sdpa.logits.save()
    assert torch.equal(_logits(sdpa), clean)


@pytest.mark.parametrize("edit", [lambda g: g.__setitem__(slice(None), 0), lambda g: g.data.zero_()],
                         ids=["in-place", ".data"])
def test_an_in_place_edit_of_the_read_only_gradient_is_refused(sdpa, edit):
    """``g = p.grad; g[:] = 0`` did not change ``query_states.grad`` under sdpa (it does under eager): refused now,
    as ``p.grad = ...`` is; reading the gradient without editing it still gives eager's (test_attention_states)."""
    attention = sdpa.layers[0].self_attn
    with pytest.raises(InvalidWrite, match=r"attention_probabilities\.grad was edited in place, but the probabilities "
                       r"are recomputed beside the kernel under attn_implementation='sdpa'"):
        with sdpa.trace(PROMPTS[0]):
            query = attention.query_states
            probabilities = attention.attention_probabilities
            logit = sdpa.logits[0, -1, 5]
            with logit.backward():
                edit(probabilities.grad)
                query.grad.save()


# -- 8. writes to .grad, checked as value writes are ---------------------------------------------------------------


@pytest.mark.parametrize("value, match", [
    (lambda g: torch.zeros(3), r"shape \(3,\) does not broadcast to \(1, \d+, 32\)"),
    (lambda g: torch.zeros_like(g, dtype=torch.float64), r"dtype torch\.float64 is not torch\.float32"),
    (lambda g: torch.zeros_like(g, device="meta"), r"device meta is not cpu"),
    (lambda g: 0.0, r"was assigned a float\. It takes a tensor of shape \(1, \d+, 32\), dtype torch\.float32"),
    (lambda g: None, r"was assigned None, which would leave the gradient as it is.*torch\.zeros_like"),
], ids=["shape", "float64", "meta", "python-float", "none"])
def test_a_gradient_write_that_cannot_fit_is_an_invalid_write(llama, value, match):
    """Was torch's ``hook 'hook' has changed the size/type of value``, ``TypeError: expected Variable``, or (None)
    silently ignored."""
    clean = _logits(llama)
    with pytest.raises(InvalidWrite, match=r"layers\[1\]\.mlp\.mlp_output\.grad .*" + match):
        with llama.trace(PROMPTS[0]):
            mlp = llama.layers[1].mlp.mlp_output
            logit = llama.logits[0, -1, 5]
            with logit.backward():
                mlp.grad = value(mlp.grad)
    assert torch.equal(_logits(llama), clean)


def test_a_gradient_write_that_broadcasts_equals_the_full_write(llama):
    streams = []
    for zeros in (lambda g: torch.zeros_like(g), lambda g: torch.zeros(())):
        with llama.trace(PROMPTS[0]):
            stream = llama.layers[0].layer_input
            mlp = llama.layers[1].mlp.mlp_output
            logit = llama.logits[0, -1, 5]
            with logit.backward():
                mlp.grad = zeros(mlp.grad)
                streams.append(stream.grad.save())
    assert torch.equal(streams[0], streams[1]) and streams[0].abs().sum() > 0


def test_an_fp32_gradient_into_a_bf16_model_is_named():
    model = tiny_model("llama", dtype=torch.bfloat16)
    with pytest.raises(InvalidWrite, match=r"dtype torch\.float32 is not torch\.bfloat16 \(use \.to\(torch\."
                       r"bfloat16\)\)"):
        with model.trace(PROMPTS[0]):
            mlp = model.layers[1].mlp.mlp_output
            logit = model.logits[0, -1, 5]
            with logit.backward():
                mlp.grad = mlp.grad.float()


# -- 4. a config changed after its proof -----------------------------------------------------------------------------


def test_a_config_changed_after_the_proof_is_refused_at_the_next_trace(monkeypatch, tmp_path):
    """``residual_multiplier *= 3`` after the load: the model computes with the new factor, the proof was of the old
    one (the contribution identity went from 0 to 1.2e-2, silently). Refused by name at the next trace; a change the
    proof does not key on (``use_cache``) is not; set back, the model traces again and the identity holds."""
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    model = StandardizedTransformer(tiny_hf_model("granite"), tokenizer=tiny_tokenizer())
    config = model._module.config
    config.use_cache = False
    clean = _logits(model)
    original = config.residual_multiplier
    config.residual_multiplier = original * 3
    with pytest.raises(ConfigChanged, match=re.escape(f"residual_multiplier {original!r} -> {original * 3!r}")):
        with model.trace(PROMPTS[0]):
            model.logits.save()
    config.residual_multiplier = original
    with torch.no_grad(), model.trace(PROMPTS[0]):
        x = model.layers[0].layer_input.save()
        a = model.layers[0].self_attn.attention_output.save()
        m = model.layers[0].mlp.mlp_output.save()
        y = model.layers[0].layer_output.save()
        logits = model.logits.save()
    assert torch.allclose(x + a + m, y, atol=1e-5) and torch.equal(logits, clean)


# -- 5. non-finite steering ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call, match", [
    (lambda m: steer(m, 1, torch.full((m.hidden_size,), float("nan"))), r"steer's vector holds 32 non-finite"),
    (lambda m: steer(m, 1, torch.ones(m.hidden_size), factor=float("inf")), r"steer's factor is inf"),
    (lambda m: steer(m, 1, torch.ones(m.hidden_size), factor=float("nan")), r"steer's factor is nan"),
    (lambda m: tools.mean_ablate(m, 1, "mlp_output", torch.full((m.hidden_size,), float("-inf"))),
     r"mean_ablate's mean holds 32 non-finite"),
], ids=["vector", "infinite-factor", "nan-factor", "mean"])
def test_non_finite_steering_vectors_factors_and_means_are_refused(llama, call, match):
    """Was accepted, and NaN reached the logits without a word."""
    clean = _logits(llama)
    with pytest.raises(InvalidInput, match=match), torch.no_grad(), llama.trace(PROMPTS[0]):
        call(llama)
        llama.logits.save()
    assert torch.equal(_logits(llama), clean)


def test_a_non_finite_mean_of_a_head_sweep_is_refused(llama):
    means = tools.mean_values(llama, PROMPTS, "attention_head_outputs", layers=[0])
    means[0][1, 0] = float("nan")
    with pytest.raises(InvalidInput, match=r"head_ablation_sweep's mean\[0\] holds 1 non-finite"):
        tools.head_ablation_sweep(llama, PROMPTS[0], layers=[0], mean=means)


# -- 9. tools after a failed proof -----------------------------------------------------------------------------------


def test_every_tool_names_the_cause_of_a_declined_model_level_value():
    """A proof that declined the logits (and the lens) but served every layer's values: each tool raises
    ValueNotAvailable with the cause (was ``AttributeError ... has attribute 'logits'``)."""
    model = tiny_model("llama")
    model._model_declines.update(logits="not proved: read on the model (logits): failed (CAUSE-1)",
                                 project_on_vocab="not proved: lens on the model: failed (CAUSE-2)")
    ids, other = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[5, 6, 9, 8]])
    calls = {
        "activation_patching": lambda: tools.activation_patching(model, ids, other),
        "attribution_patching": lambda: tools.attribution_patching(model, ids, other, lambda logits: logits[:, -1, 5]),
        "head_ablation_sweep": lambda: tools.head_ablation_sweep(model, PROMPTS[0]),
        "patch": lambda: tools.patch(model, ids, other, "layer_output", 0),
        "direct_logit_attribution": lambda: tools.direct_logit_attribution(model, PROMPTS[0], 5),
        "cache_activations": lambda: tools.cache_activations(model, PROMPTS[0]),
    }
    for call in calls.values():
        with pytest.raises(ValueNotAvailable, match=r"model\.logits is not available: .*CAUSE-1"):
            call()
    with pytest.raises(ValueNotAvailable, match=r"model\.project_on_vocab is not available: .*CAUSE-2"):
        tools.logit_lens(model, PROMPTS[0])


# -- 10, 11. two wrappers of one module; hasattr outside a trace -----------------------------------------------------


def test_a_trace_of_another_wrapper_of_the_same_module_inside_a_trace_is_nested():
    """Was nnsight's ``ValueError: cyclic parent chain`` (or an out-of-order read)."""
    hf = tiny_hf_model("llama")
    first = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), verify="never")
    second = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), verify="never")
    clean = _logits(first)
    with pytest.raises(NestedTrace, match="through another nncanon model over the same torch module"):
        with torch.no_grad(), first.trace(PROMPTS[0]):
            first.logits.save()
            with second.trace(PROMPTS[0]):
                second.logits.save()
    assert torch.equal(_logits(first), clean) and torch.equal(_logits(second), clean)


def test_hasattr_outside_a_trace_answers_whether_the_value_is_served():
    """Was nnsight's ``ValueError: Cannot access ... outside of interleaving`` for a served value (declined ones
    answered False)."""
    model = tiny_model("gpt2", reorder_and_upcast_attn=True)  # declines the kernel's inputs, serves the rest
    attention = model.layers[0].self_attn
    assert model.support().declined(0) == ["query_states", "key_states", "value_states"]
    assert not hasattr(attention, "query_states") and not hasattr(attention, "key_states")
    for host, name in ((attention, "attention_probabilities"), (attention, "attention_head_outputs"),
                       (attention, "attention_output"), (model.layers[0], "layer_output"),
                       (model.layers[0].mlp, "mlp_output"), (model, "logits"), (model, "next_token_probs")):
        assert hasattr(host, name), name
    assert not hasattr(attention, "mlp_output")  # a value of another component


@pytest.mark.parametrize("use", [
    lambda v: v.save(), lambda v: v[:, -1], lambda v: v + 1, lambda v: torch.softmax(v, -1), lambda v: v.shape,
    lambda v: bool(v),
], ids=["save", "index", "add", "torch-function", "shape", "bool"])
def test_a_value_used_outside_a_trace_is_not_in_trace(llama, use):
    value = llama.layers[0].layer_output
    assert repr(value) == "<layers[0].layer_output: a value served inside model.trace(...) only>"
    with pytest.raises(NotInTrace, match=r"layers\[0\]\.layer_output was used outside a trace .* inside `with "
                       r"model\.trace\(prompt\):`"):
        use(value)


@pytest.mark.parametrize("write, name", [
    (lambda m: setattr(m.layers[0].mlp, "mlp_output", torch.zeros(1)), r"layers\[0\]\.mlp\.mlp_output was written"),
    (lambda m: setattr(m.layers[0].self_attn, "attention_probabilities", torch.zeros(1)),
     r"layers\[0\]\.self_attn\.attention_probabilities was written"),
    (lambda m: setattr(m, "logits", torch.zeros(1)), r"model\.logits was written"),
    (lambda m: m.skip_layers(1), r"model\.skip_layers\(1, None\) was called"),
    (lambda m: steer(m, 1, torch.ones(m.hidden_size)), r"steer\(model, \.\.\.\) was called"),
    (lambda m: tools.zero_ablate_mlp(m, 1), r"an ablation \(zero_ablate, mean_ablate and the like\) was called"),
], ids=["value", "probabilities", "logits", "skip", "steer", "ablation"])
def test_a_write_or_a_tool_outside_a_trace_is_not_in_trace(llama, write, name):
    with pytest.raises(NotInTrace, match=name + r" outside a trace\. Values exist only while the model runs"):
        write(llama)


def test_a_trace_that_runs_nothing_says_so(llama):
    with pytest.raises(NotInTrace, match=r"model\.logits was read in a trace that runs nothing: model\.trace\(\) was "
                       r"given no input and opened no invoke"):
        with llama.trace():
            llama.logits.save()


# -- 12. the bare errors left ----------------------------------------------------------------------------------------


def test_a_standard_value_of_another_component_is_named(llama):
    with pytest.raises(ValueNotAvailable, match=r"layers\[0\]\.self_attn\.mlp_output does not exist: mlp_output is a "
                       r"value of layers\[0\]\.mlp, not of layers\[0\]\.self_attn\. Read model\.layers\[0\]\.mlp\."
                       r"mlp_output\."):
        llama.layers[0].self_attn.mlp_output
    with pytest.raises(ValueNotAvailable, match=r"linear_attention_output is a value of layers\[0\]\.linear_attn"):
        with llama.trace(PROMPTS[0]):
            llama.layers[0].self_attn.linear_attention_output.save()


def test_an_in_place_write_of_the_wrong_shape_is_an_invalid_write(llama):
    """Was torch's RuntimeError (an assignment of the same tensor gets `InvalidWrite`, and says what it expects)."""
    clean = _logits(llama)
    with pytest.raises(InvalidWrite, match=r"the in-place write at .*test_edges_wave2\.py:\d+ \(`llama\.layers\[0\]\."
                       r"mlp\.mlp_output\[:\] = torch\.zeros\(3\)`\) failed: The expanded size of the tensor \(32\)"):
        with llama.trace(PROMPTS[0]):
            llama.layers[0].mlp.mlp_output[:] = torch.zeros(3)
    with pytest.raises(InvalidWrite, match=r"the in-place write at .*\(`output \+= torch\.zeros\(3\)`\) failed"):
        with llama.trace(PROMPTS[0]):
            output = llama.layers[0].mlp.mlp_output
            output += torch.zeros(3)
    assert torch.equal(_logits(llama), clean)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_backward_in_a_trace_without_gradients_is_named(llama, mode):
    """Was nnsight's NotImplementedError (``with loss.backward():``) or torch's RuntimeError (``loss.backward()``)."""
    name = f"torch.{mode.__name__}()"
    for backward in ("with", "call"):
        with pytest.raises(GradientNotAvailable, match=rf"a backward was asked in a trace run under {re.escape(name)}"):
            with mode(), llama.trace(PROMPTS[0]):
                logit = llama.logits[0, -1, 5]
                if backward == "with":
                    with logit.backward():
                        pass
                else:
                    logit.backward()


@pytest.mark.parametrize("call, error, match", [
    (lambda m: m.trace(12345), InvalidInput, r"model\.trace / model\.generate was given 12345 \(int\): give a string"),
    (lambda m: tools.logit_lens(m, None), InvalidInput, r"the prompts given are None \(NoneType\): give a string"),
    (lambda m: tools.attribution_patching(m, PROMPTS[0], None, logit_difference(10**6, 6)), InvalidInput,
     r"logit_difference\(1000000, 6\): token\(s\) \[1000000\] are outside the logits' vocabulary of 300 tokens"),
], ids=["trace-of-an-int", "lens-of-none", "logit-difference-outside-the-vocabulary"])
def test_inputs_no_tokenizer_takes_are_named(llama, call, error, match):
    with pytest.raises(error, match=match):
        with call(llama):
            llama.logits.save()


def test_steer_with_a_list_is_named(llama):
    with pytest.raises(InvalidInput, match=r"steer's vector is a list; it takes a tensor \[hidden\]"):
        with llama.trace(PROMPTS[0]):
            steer(llama, 1, [0.0] * llama.hidden_size)


def test_what_the_load_is_given_is_named(tmp_path):
    hf = tiny_hf_model("llama")
    with pytest.raises(InvalidArgument, match=r"verify='bogus' is not one of 'auto', 'always', 'never'") as raised:
        StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), verify="bogus")
    assert isinstance(raised.value, ValueError)
    with pytest.raises(TokenizerNotFound, match=r"given a built LlamaForCausalLM without tokenizer=, and its config "
                       r"names no checkpoint"):
        StandardizedTransformer(hf)
    with pytest.raises(InvalidModel, match=r"given a LlamaModel, which has no language-model head \('lm_head'\): it "
                       r"is a base model"):
        StandardizedTransformer(hf.model, tokenizer=tiny_tokenizer())


@pytest.mark.parametrize("content", ["", '{"model_type": "llama", "hidden_', "null"],
                         ids=["empty", "truncated", "null"])
def test_a_config_file_that_cannot_be_read_is_named(tmp_path, content):
    tiny_hf_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(InvalidCheckpoint, match=re.escape(f"the config file {tmp_path / 'config.json'} is not a JSON "
                                                          "object")):
        StandardizedTransformer(str(tmp_path))


def test_a_weight_file_that_cannot_be_read_is_named(tmp_path):
    """At the first trace (the load builds on meta) and at a load with ``dispatch=True``: was safetensors' own
    ``SafetensorError: Error while deserializing header`` naming no file."""
    tiny_hf_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage" * 100)
    model = StandardizedTransformer(str(tmp_path), verify="never")
    named = re.escape(f"the weight file {tmp_path / 'model.safetensors'} cannot be read (SafetensorError")
    with pytest.raises(InvalidCheckpoint, match=named), model.trace(PROMPTS[0]):
        model.logits.save()
    with pytest.raises(InvalidCheckpoint, match=named):
        StandardizedTransformer(str(tmp_path), verify="never", dispatch=True)



@pytest.mark.parametrize("cut", [False, True])
def test_a_pytorch_weight_file_that_cannot_be_read_is_named(tmp_path, cut):
    """A ``pytorch_model.bin`` that is garbage, or a real one cut short: was torch's ``UnpicklingError`` advising
    ``weights_only=False`` (arbitrary code execution), naming no file."""
    model = tiny_hf_model("llama")
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    weights = tmp_path / "pytorch_model.bin"
    torch.save(model.state_dict(), weights)
    weights.write_bytes(weights.read_bytes()[:1000] if cut else b"garbage" * 100)
    named = re.escape(f"the weight file {weights} cannot be read (neither a zip archive")
    with pytest.raises(InvalidCheckpoint, match=named):
        StandardizedTransformer(str(tmp_path), verify="never", dispatch=True)
    loaded = StandardizedTransformer(str(tmp_path), verify="never")
    with pytest.raises(InvalidCheckpoint, match=named), loaded.trace(PROMPTS[0]):
        loaded.logits.save()

# -- 13. an out-of-order read the skip made --------------------------------------------------------------------------


def test_a_read_before_a_skip_it_was_made_after_names_the_skip(llama):
    """Was "... was read, after layers[1].layer_input": a read the user never wrote (the skip's own)."""
    with pytest.raises(OutOfOrderRead, match=r"layers\[0\]\.layer_output was read after skip_layers\(1, 2\) in the "
                       r"same trace: to skip, the model ran on to layers\[1\]\.layer_input"):
        with llama.trace(PROMPTS[0]):
            llama.skip_layers(1, 2)
            llama.layers[0].layer_output.save()


def test_the_errors_are_exported():
    for name in ("ConfigChanged", "InvalidArgument", "InvalidCheckpoint", "NotInTrace"):
        assert issubclass(getattr(nncanon, name), nncanon.NncanonError)


@pytest.mark.parametrize("edit", ["copy_", "add_", "mul_"])
def test_an_in_place_method_of_the_wrong_shape_is_an_invalid_write_naming_the_value(llama, edit):
    """``value.copy_(t)`` and the other in-place methods, as ``value[...] = t``: was torch's RuntimeError."""
    clean = _logits(llama)
    with pytest.raises(InvalidWrite, match=rf"the in-place write at .*\(`output\.{edit}\(torch\.ones\(3\)\)`\) failed: "
                                           r".*`output` is layers\[0\]\.mlp\.mlp_output \[1, \d+, 32\] float32\."):
        with llama.trace(PROMPTS[0]):
            output = llama.layers[0].mlp.mlp_output
            if edit == "copy_":
                output.copy_(torch.ones(3))
            elif edit == "add_":
                output.add_(torch.ones(3))
            else:
                output.mul_(torch.ones(3))
    assert torch.equal(_logits(llama), clean)
