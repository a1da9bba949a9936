"""Quantized and half-precision models: the surface on the quantized model equals plain torch hooks on the same
quantized model, the proof ran on a twin quantized the same way, bars scale by one rule, and what cannot be served
is refused by name. bitsandbytes is imported at module level: CI installs it (the ``quant`` extra), so these tests
never skip."""

from __future__ import annotations

import contextlib
import warnings

import bitsandbytes as bnb
import pytest
import torch
import transformers
from transformers import BitsAndBytesConfig

import nncanon
from nncanon.families import REGISTRY
from nncanon.proof import cache as proof_cache
from nncanon.proof.checks.base import PRECISION, TOLERANCE, scaled
from nncanon.quantization import Quantization, _cpu_packs, declared, dense_weight, is_quantized
from nncanon.sae import value_at
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_tokenizer
from nncanon.tools.heads import attention_head_contributions, projection_weights

#: A Llama 64 wide (bitsandbytes' 4-bit CPU kernel takes widths that are multiples of its block of 64).
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}

LOADS = {
    "int8": {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)},
    "nf4": {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_compute_dtype=torch.float32)},
    "fp4-bf16": {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4",
                                                           bnb_4bit_compute_dtype=torch.bfloat16),
                 "dtype": torch.bfloat16},
}
DESCRIBED = {"int8": "bitsandbytes int8, compute float32", "nf4": "bitsandbytes nf4, compute float32",
             "fp4-bf16": "bitsandbytes fp4, compute bfloat16"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama64")
    tiny_hf_model("llama", **SIZES).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def loaded(folder):
    cache: dict = {}

    def load(name: str, **extra) -> nncanon.StandardizedTransformer:
        key = (name, tuple(sorted(extra)))
        if key not in cache:
            options = {**LOADS.get(name, {}), **extra}
            cache[key] = nncanon.StandardizedTransformer(folder, device_map="cpu", dispatch=True, **options)
        return cache[key]

    return load


def _hooked(model, prompt: str) -> dict:
    """Block 0's stream, heads, contributions and the logits read by plain torch hooks on the same (quantized)
    module, with no nncanon in the way."""
    hf, seen = model._module, {}
    block = hf.model.layers[0]
    handles = [
        block.register_forward_pre_hook(lambda m, args, kwargs: seen.__setitem__("layer_input", args[0].clone())
                                        if args else seen.__setitem__("layer_input", kwargs["hidden_states"].clone()),
                                        with_kwargs=True),
        block.self_attn.o_proj.register_forward_pre_hook(lambda m, args: seen.__setitem__("heads", args[0].clone())),
        block.self_attn.register_forward_hook(lambda m, a, out: seen.__setitem__("attention_output", out[0].clone())),
        block.mlp.register_forward_hook(lambda m, a, out: seen.__setitem__("mlp_output", out.clone())),
        block.register_forward_hook(lambda m, a, out: seen.__setitem__(
            "layer_output", (out[0] if isinstance(out, tuple) else out).clone())),
    ]
    try:
        with torch.no_grad():
            seen["logits"] = hf(**model.tokenizer(prompt, return_tensors="pt")).logits
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("name", list(LOADS))
def test_served_values_equal_plain_hooks_on_the_same_quantized_model(loaded, name):
    model = loaded(name)
    assert model.support().provenance.startswith(f"proved on a twin quantized as this model ({DESCRIBED[name]})")
    assert model.quantization.describe() == DESCRIBED[name]
    with torch.no_grad(), model.trace(PROMPTS[0]):
        x = model.layers[0].layer_input.save()
        heads = model.layers[0].self_attn.attention_head_outputs.save()
        attention = model.layers[0].self_attn.attention_output.save()
        mlp = model.layers[0].mlp.mlp_output.save()
        y = model.layers[0].layer_output.save()
        logits = model.logits.save()
    assert is_quantized(model._module.model.layers[0].self_attn.o_proj)
    reference = _hooked(model, PROMPTS[0])  # (after the trace: bitsandbytes repacks at its first forward)
    for served, expected in ((x, "layer_input"), (attention, "attention_output"), (mlp, "mlp_output"),
                             (y, "layer_output"), (logits, "logits")):
        assert torch.equal(served, reference[expected]), expected  # taken over: bit for bit
    assert torch.equal(heads.flatten(-2), reference["heads"]) and heads.shape[-2:] == (4, 16)
    bar = scaled_bar(model)
    assert ((x + attention + mlp) - y).abs().max() <= bar * (1 + y.abs().max())  # contribution identity


def scaled_bar(model) -> float:
    token = PRECISION.set(model.quantization.precision)
    try:
        return scaled(TOLERANCE)
    finally:
        PRECISION.reset(token)


def test_one_rule_scales_every_bar_with_the_format():
    cases = ((torch.float32, TOLERANCE), (torch.bfloat16, 8 * 2.0 ** -7), (torch.float16, 8 * 2.0 ** -10))
    for dtype, expected in cases:
        token = PRECISION.set(torch.finfo(dtype).eps)
        try:
            assert scaled(TOLERANCE) == pytest.approx(expected) and scaled(0.0) == 0.0
        finally:
            PRECISION.reset(token)
    assert Quantization("bitsandbytes", "int8").precision == 2.0 ** -7
    assert Quantization("bitsandbytes", "nf4", compute=torch.float32).precision == (
        2.0 ** -7 if _cpu_packs() else torch.finfo(torch.float32).eps)


def test_the_cache_key_knows_the_quantization():
    config = transformers.LlamaConfig(**SIZES)
    family, cls = REGISTRY["llama"], transformers.LlamaForCausalLM
    keys = {name: proof_cache.cache_key(config, family, cls, declared(config, options).key())
            for name, options in LOADS.items()}
    keys["float32"] = proof_cache.cache_key(config, family, cls)
    keys["bfloat16"] = proof_cache.cache_key(config, family, cls, declared(config, {"dtype": torch.bfloat16}).key())
    assert len(set(keys.values())) == len(keys)


def test_the_proof_ran_on_a_quantized_twin(loaded):
    proof = loaded("nf4")._provenance.proof
    assert {r.check for r in proof.verdict.results} >= {"quantized_gradients", "heads", "read", "identity"}
    held = [r for r in proof.verdict.results if r.check == "heads"]
    assert held and all(r.passed for r in held)  # the dequantized weight's head slices sum to the 4-bit output


def test_gradients_where_the_quantized_layers_pass_them(loaded):
    model = loaded("int8")  # bitsandbytes' int8 layers pass gradients to their inputs
    target = 5
    with model.trace(PROMPTS[0]):
        mlp = model.layers[0].mlp.mlp_output
        logit = model.logits[0, -1, target]
        with logit.backward():
            ours = mlp.grad.save()
    seen = {}
    hf = model._module
    handle = hf.model.layers[0].mlp.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out))
    try:
        with torch.enable_grad():
            logits = hf(**model.tokenizer(PROMPTS[0], return_tensors="pt")).logits
            (expected,) = torch.autograd.grad(logits[0, -1, target], seen["out"])
    finally:
        handle.remove()
    assert torch.equal(ours, expected)


def test_gradients_declined_with_the_reason_where_they_do_not_pass(loaded):
    model = loaded("nf4")
    reason = model.support().gradient_reason("mlp_output", 0)
    if not _cpu_packs():  # (elsewhere bitsandbytes' 4-bit layers pass their gradients: .grad is served)
        assert reason is None
        return
    assert "quantized_gradients" in reason and "Linear4bit" in reason
    with pytest.raises(nncanon.GradientNotAvailable, match="quantized_gradients"):
        with model.trace(PROMPTS[0]):
            mlp = model.layers[0].mlp.mlp_output
            with model.logits[0, -1, 5].backward():
                mlp.grad.save()


def test_writes_are_checked_against_the_compute_dtype(loaded):
    model = loaded("nf4")
    with pytest.raises(nncanon.InvalidWrite, match="integer"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            model.layers[0].mlp.mlp_output = torch.zeros(1, 1, 64, dtype=torch.int64)
    half = loaded("fp4-bf16")
    with pytest.raises(nncanon.InvalidWrite, match=r"dtype torch\.float32 is not torch\.bfloat16"):
        with torch.no_grad(), half.trace(PROMPTS[0]):
            half.layers[0].mlp.mlp_output = torch.zeros(1, 1, 64)
    with torch.no_grad(), half.trace(PROMPTS[0]):  # a write in the stream's own dtype goes through
        x = half.layers[0].layer_input.save()
        attention = half.layers[0].self_attn.attention_output.save()
        half.layers[0].mlp.mlp_output = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
        out = half.layers[0].layer_output.save()
    assert torch.equal(out, x + attention)


def test_a_quantized_weight_is_not_served_through_the_surface(loaded):
    model = loaded("nf4")
    projection = model.layers[0].self_attn.o_proj
    with pytest.raises(nncanon.ValueNotAvailable, match="held quantized"):
        projection.weight  # its storage is packed
    with pytest.raises(nncanon.InvalidWrite, match="dense_weight"):
        projection.weight = torch.nn.Parameter(torch.zeros(64, 64))
    assert dense_weight(projection._module).shape == (64, 64)


def test_head_weights_read_the_declared_width_not_the_packed_storage(loaded):
    """A family or tool that split ``module.weight`` by shape would break on a packed 4-bit weight: on purpose,
    the storage shape is not ``[out, in]``, yet the per-head projection sums to the layer's own output."""
    model = loaded("nf4")
    module = model._module.model.layers[0].self_attn.o_proj
    assert tuple(module.weight.shape) != (64, 64)  # packed: reading its shape would mislead
    by_input = module.weight.T  # the reading of a Linear's weight by its shape, as before: it breaks on purpose
    try:
        old = tuple(by_input.reshape(4, -1, by_input.shape[-1]).shape)
    except RuntimeError:
        old = None
    assert old != (4, 16, 64)
    weight, bias = projection_weights(model, 0)
    assert weight.shape == (4, 16, 64) and bias is None
    seen = {}
    handle = module.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out.clone()))
    try:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            per_head = attention_head_contributions(model, 0).save()
    finally:
        handle.remove()
    bar = scaled_bar(model)
    assert (per_head.sum(-2) - seen["out"]).abs().max() <= bar * (1 + seen["out"].abs().max())
    with torch.no_grad(), model.trace(PROMPTS[0]):  # TransformerLens's attn.hook_result: the same split
        result = value_at(model, "blocks.0.attn.hook_result").save()
    assert result.shape == per_head.shape
    assert (result.sum(-2) - seen["out"]).abs().max() <= bar * (1 + seen["out"].abs().max())


def test_sizes_and_the_lens_with_a_quantized_or_tied_head(tmp_path, folder):
    tied = tmp_path / "tied"
    tiny_hf_model("llama", tie_word_embeddings=True, **SIZES).save_pretrained(tied)
    tiny_tokenizer().save_pretrained(tied)
    every_layer = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=[])  # the head quantized too
    for where, options, head in ((folder, {"quantization_config": every_layer}, True),
                                 (str(tied), LOADS["nf4"], False)):
        model = nncanon.StandardizedTransformer(where, device_map="cpu", dispatch=True, **options)
        assert is_quantized(model.lm_head._module) == head
        assert (model.num_heads, model.head_dim, model.hidden_size, model.num_kv_heads) == (4, 16, 64, 2)
        with torch.no_grad(), model.trace(PROMPTS):
            lens = model.project_on_vocab(model.layers[-1].layer_output).save()
            logits = model.logits.save()
        assert torch.equal(lens, logits)


def test_a_model_quantized_after_the_load_is_refused_at_the_next_trace(folder):
    model = nncanon.StandardizedTransformer(folder, device_map="cpu")
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.logits.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.logits.save()
    model._module.model.layers[0].mlp.down_proj = bnb.nn.Linear8bitLt(128, 64, bias=False, has_fp16_weights=False)
    with pytest.raises(nncanon.ModelChanged, match="changed since its proof"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            model.logits.save()


def test_a_built_model_quantized_after_the_load_is_refused_before_its_first_trace(folder):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model = nncanon.StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    hf.model.layers[1].mlp.up_proj = bnb.nn.Linear8bitLt(64, 128, bias=False, has_fp16_weights=False)
    with pytest.raises(nncanon.ModelChanged):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            model.logits.save()


def test_a_method_not_installed_or_not_runnable_is_refused_in_one_line(folder, monkeypatch):
    with pytest.raises(nncanon.QuantizationUnavailable, match="'gptqmodel'") as caught:
        nncanon.StandardizedTransformer(folder, quantization_config={"quant_method": "gptq", "bits": 4})
    assert "\n" not in str(caught.value) and "pip install torch==2.13.0 gptqmodel" in str(caught.value)
    monkeypatch.setattr("nncanon.quantization._installed", lambda module: module != "bitsandbytes")
    with pytest.raises(nncanon.QuantizationUnavailable, match="bitsandbytes quantization needs the 'bitsandbytes'"):
        nncanon.StandardizedTransformer(folder, **LOADS["nf4"])
    monkeypatch.undo()
    # HQQ: installed, transformers 5.24 cannot quantize with it ("not available yet"); not installed, the package named
    with pytest.raises(nncanon.QuantizationUnavailable, match=r"hqq quantization(, package 'hqq' does not run| needs)"):
        nncanon.StandardizedTransformer(folder, quantization_config={"quant_method": "hqq", "nbits": 4})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_is_proved_on_a_twin_cast_as_it(loaded, folder, dtype):
    model = loaded(str(dtype), dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    assert model.support().provenance.startswith(f"proved on a twin cast as this model ({name})")
    assert model.quantization.precision == torch.finfo(dtype).eps
    assert not model.support().declined(0)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        mlp = model.layers[0].mlp.mlp_output.save()
        logits = model.logits.save()
    reference = _hooked(model, PROMPTS[0])
    assert torch.equal(mlp, reference["mlp_output"]) and torch.equal(logits, reference["logits"])


@pytest.mark.parametrize("method", ["torchao", "quanto"])
def test_other_methods_that_run_here(folder, method):
    if method == "torchao":  # not in the test extra: its import writes CUDA library errors to stderr (pyproject)
        pytest.importorskip("torchao", reason="torchao is not installed (pip install torch==2.13.0 torchao==0.18.0)")
        from torchao.quantization import Int8WeightOnlyConfig

        config, described = transformers.TorchAoConfig(Int8WeightOnlyConfig()), "torchao int8 weight-only"
    else:
        config, described = transformers.QuantoConfig(weights="int8"), "quanto weights int8"
    model = nncanon.StandardizedTransformer(folder, device_map="cpu", quantization_config=config)
    assert model.support().provenance.startswith(f"proved on a twin quantized as this model ({described}, compute")
    assert not model.support().declined(0) and model.support().gradient_reason("mlp_output", 0) is None
    with torch.no_grad(), model.trace(PROMPTS[0]):
        mlp = model.layers[0].mlp.mlp_output.save()
        logits = model.logits.save()
    reference = _hooked(model, PROMPTS[0])
    assert torch.equal(mlp, reference["mlp_output"]) and torch.equal(logits, reference["logits"])
    assert is_quantized(model._module.model.layers[0].mlp.down_proj)


def _three_invokes(model, outlier: bool) -> list[torch.Tensor]:
    """The logits of three invokes; with ``outlier``, the middle one's stream after block 0 given a feature far past
    LLM.int8's threshold (6.0)."""
    logits = []
    with torch.no_grad(), model.trace() as tracer:
        for index, prompt in enumerate((PROMPTS[0], PROMPTS[0], PROMPTS[1])):
            with tracer.invoke(prompt):
                if outlier and index == 1:
                    model.layers[0].layer_output[..., 3] = 100.0
                logits.append(model.logits.save())
    return logits


@pytest.mark.parametrize("threshold", [6.0, 0.0])
def test_llm_int8_outlier_columns_couple_a_batch_and_the_model_says_so(folder, threshold):
    """LLM.int8 takes an input column out of the int8 product for every row when one row exceeds the threshold: an
    outlier in one invoke moves the others (a property of the model: plain hooks on the unwrapped model show it
    too). ``support().batch`` says so, the first trace warns once, and with ``llm_int8_threshold=0.0`` the invokes
    are independent again, bit for bit."""
    model = nncanon.StandardizedTransformer(folder, device_map="cpu", dispatch=True, quantization_config=(
        BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold)))
    coupled = threshold > 0
    assert (model.support().batch is not None) == coupled
    assert ("batch tokens computed together: bitsandbytes LLM.int8" in str(model.support())) == coupled
    with pytest.warns(nncanon.BatchCoupledWarning, match="llm_int8_threshold=0.0") if coupled else _no_warning():
        clean = _three_invokes(model, outlier=False)
    edited = _three_invokes(model, outlier=True)
    moved = max(float((edited[i] - clean[i]).abs().max()) for i in (0, 2))
    assert (moved > 0) == coupled
    assert not torch.equal(edited[1], clean[1])
    # The same with plain hooks on the unwrapped model: block 0's output row 1 given the outlier.
    hf = model._module
    batch = model.tokenizer([PROMPTS[0], PROMPTS[0], PROMPTS[1]], return_tensors="pt", padding=True)

    def outlier(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        hidden[1, :, 3] = 100.0
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    with torch.no_grad():
        plain_clean = hf(**batch).logits
        handle = hf.model.layers[0].register_forward_hook(outlier)
        try:
            plain_edited = hf(**batch).logits
        finally:
            handle.remove()
    assert (float((plain_edited[[0, 2]] - plain_clean[[0, 2]]).abs().max()) > 0) == coupled
    with _no_warning():  # (once per model)
        _three_invokes(model, outlier=False)


@contextlib.contextmanager
def _no_warning():
    """`BatchCoupledWarning` raised, so a block that warns fails."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", nncanon.BatchCoupledWarning)
        yield


@pytest.mark.parametrize("nested", [False, True])  # (transformers' default: bnb_4bit_use_double_quant=False)
@pytest.mark.parametrize("in_features", [64, 128, 320])
def test_dense_weight_is_what_a_repacked_4bit_layer_computes_with(in_features, nested):
    """bitsandbytes repacks a 4-bit weight for an AVX512-BF16 CPU at its first forward without gradients; its own
    inverse leaves the scales of an unnested layer wider than one block (64) transposed (a weight read back 40% off on
    gemma4's 128-wide o_proj). `dense_weight` is what the layer computes with, at any width."""
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(in_features, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(64, in_features) * 0.05, requires_grad=False, quant_type="nf4",
                                     compress_statistics=nested)
    layer = layer.to("cpu").eval()
    x = torch.randn(2, 5, in_features)
    with torch.no_grad():
        layer(x)  # (repacks, where this CPU has AVX512-BF16)
        out = layer(x)
        weight = dense_weight(layer)
        terms = x.abs() @ weight.abs().T
    assert getattr(layer.weight.quant_state, "packing_format_for_cpu", False) == _cpu_packs()
    assert weight.shape == (64, in_features)
    assert bool(((out - x @ weight.T).abs() <= 8 * 2.0 ** -8 * terms).all())  # bfloat16 accumulation at most


def test_a_family_that_computes_the_lens_itself_uses_the_quantized_layers_own_kernel(tmp_path):
    """Gemma-3n's lens runs its AltUp unembedding projections: through the layer's own forward (its int8 kernel),
    not a float matmul with the dequantized weight, which was 2.8e-3 off the logits under LLM.int8."""
    hf = tiny_hf_model("gemma3n_text")
    hf.save_pretrained(tmp_path)
    tiny_tokenizer(hf.config.vocab_size).save_pretrained(tmp_path)
    model = nncanon.StandardizedTransformer(str(tmp_path), device_map="cpu", dispatch=True, **LOADS["int8"])
    assert is_quantized(model._module.model.altup_unembed_projections[0])
    declines = model.support().model_declines
    assert "project_on_vocab" not in declines and "skip_layers" not in declines
    with torch.no_grad(), model.trace(PROMPTS[0]):
        lens = model.project_on_vocab(model.layers[-1].layer_output).save()
        logits = model.logits.save()
    assert torch.equal(lens, logits)
