"""Gemma-3n: AltUp streams stacked first ([k, b, s, d]), served [b, s, k·d]; what is served, refused, declined.

The invariant suite (tests/families) runs every check of the verifier on the ``gemma3n_text`` variants. Here:
the multimodal model's text path (its record needs timm for the vision tower, so the suite skips it where
timm is missing: this builds it with the tower left out, which text never runs), the stream layout against
the model's own stack, per-invoke writes, and the refusals.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import nncanon
from nncanon import InvalidInput, InvalidSkip, StandardizedTransformer, ValueNotAvailable
from nncanon.proof.checks.references import hf_block
from nncanon.proof.twin import perturb
from nncanon.proof.verdict import verify
from nncanon.registry import records
from nncanon.testing import PROMPTS, tiny_model, tiny_tokenizer

from .conftest import skip_unavailable


@pytest.fixture(scope="module")
def model():
    skip_unavailable("gemma3n_text")  # (transformers 5.20 cannot run it: the record says why)
    return tiny_model("gemma3n_text")


def _multimodal(monkeypatch) -> torch.nn.Module:
    """Gemma3nForConditionalGeneration of the ``gemma3n`` variant; the timm vision tower replaced by an
    empty module where timm is not installed (a text forward never calls it)."""
    from transformers.models.gemma3n import modeling_gemma3n

    build = modeling_gemma3n.AutoModel.from_config

    def from_config(config, *args, **kwargs):
        if isinstance(config, transformers.Gemma3nVisionConfig):
            return torch.nn.Module()
        return build(config, *args, **kwargs)

    try:
        import timm  # noqa: F401
    except ImportError:
        monkeypatch.setattr(modeling_gemma3n.AutoModel, "from_config", from_config)
    config = transformers.Gemma3nConfig(**records()["gemma3n"]["variants"]["gemma3n"])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma3nForConditionalGeneration(config)
    perturb(hf)
    return hf.eval()


def test_the_multimodal_text_path_is_proved(monkeypatch):
    """Every check of the verifier holds on Gemma3nForConditionalGeneration's text path; the logits are
    the plain model's; the contributions are declined as on the text model."""
    hf = _multimodal(monkeypatch)
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(300), verify="never")
    assert model.family.name == "gemma3n" and model.family.layers == "model.language_model.layers"
    result = verify(model)
    assert result.passed, result.table()
    ids = model.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad(), model.trace(PROMPTS[0]):
        logits = model.logits.save()
    with torch.no_grad():
        assert torch.equal(logits, hf(input_ids=ids).logits)
    report = model.support()
    assert report.layers_with("attention_output") == report.layers_with("mlp_output") == []
    assert report.layers_with("attention_head_outputs") == list(range(model.num_layers))


def test_the_stream_is_the_models_stack_side_by_side(model):
    """``layer_output.view(b, s, k, d)[:, :, j]`` is stream ``j`` of the block's ``[k, b, s, d]`` output."""
    k, d = model._text_config.altup_num_inputs, model.hidden_size
    seen = {}
    handle = hf_block(model, 1).register_forward_hook(lambda mod, args, out: seen.__setitem__("y", out.clone()))
    try:
        with torch.no_grad(), model.trace(PROMPTS):
            y = model.layers[1].layer_output.save()
    finally:
        handle.remove()
    b, s = y.shape[:2]
    assert y.shape == (b, s, k * d) and seen["y"].shape == (k, b, s, d)
    for j in range(k):
        assert torch.equal(y.view(b, s, k, d)[:, :, j], seen["y"][j])


def _logits_with_stream_zeroed(model, layer: int, stream: int, position: int) -> torch.Tensor:
    """The plain model's logits with stream ``stream`` of block ``layer``'s output zeroed at ``position``."""
    def zero(module, args, output):
        output = output.clone()
        output[stream, :, position] = 0
        return output

    handle = hf_block(model, layer).register_forward_hook(zero)
    try:
        with torch.no_grad():
            return model._module(**model.tokenizer(PROMPTS[0], return_tensors="pt")).logits
    finally:
        handle.remove()


def test_a_write_to_one_stream_reaches_the_model_in_its_own_invoke(model):
    """Zeroing stream 2 at one position of ``layers[1].layer_output`` in the middle invoke of three equals
    the plain model with that element of the stack zeroed; the other invokes are bit-identical."""
    k, d = model._text_config.altup_num_inputs, model.hidden_size
    runs = {}
    for write in (False, True):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                first = model.logits.save()
            with tracer.invoke(PROMPTS[0]):
                if write:
                    model.layers[1].layer_output[:, 3, 2 * d:3 * d] = 0
                middle = model.logits.save()
            with tracer.invoke(PROMPTS[1]):
                last = model.logits.save()
        runs[write] = (first, middle, last)
    assert k > 3 and len({k, 3}) == 2  # three rows in all: not the stream count (see the next test)
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][2], runs[False][2])
    expected = _logits_with_stream_zeroed(model, 1, 2, 3)
    assert not torch.equal(runs[True][1], runs[False][1])
    torch.testing.assert_close(runs[True][1], expected, rtol=0, atol=1e-6)


def test_as_many_rows_as_streams_in_several_invokes_is_refused_by_name():
    """nnsight narrows a batched value's first axis where it holds the trace's rows: on a [k, b, s, d] stack
    with k rows in all it would cut the streams. nncanon refuses that read, naming the cause."""
    model = tiny_model("gemma3n_text_unshared")  # two streams
    assert model._text_config.altup_num_inputs == 2
    with pytest.raises(InvalidInput, match="as many as the streams"):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                model.layers[0].layer_output.save()
            with tracer.invoke(PROMPTS[1]):
                model.logits.save()
    with torch.no_grad(), model.trace([PROMPTS[0], PROMPTS[1]]):  # one invoke of two rows: served
        y = model.layers[0].layer_output.save()
    assert y.shape[0] == 2 and y.shape[-1] == 2 * model.hidden_size


def test_a_skip_that_strands_shared_keys_and_values_is_refused(model):
    """layers[1] stores the full-attention keys/values layers[3] reuses: skipping it alone is refused with
    the reason; skipping through layers[3] runs, and leaves the stream as it entered."""
    with pytest.raises(InvalidSkip, match=r"layers\[1\] stores the full_attention keys/values that layers \[3\]"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            model.skip_layers(1, 2)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        entering = model.layers[1].layer_input.save()
        model.skip_layers(1, 3)
        leaving = model.layers[3].layer_output.save()
    assert torch.equal(leaving, entering)
    with pytest.raises(InvalidSkip, match="several invokes"):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                model.skip_layers(0, 3)
            with tracer.invoke(PROMPTS[1]):
                model.skip_layers(0, 3)


def test_resume_is_declined_where_blocks_share_keys_and_values(model):
    from nncanon.resuming import resume_at

    assert "reuse the keys/values" in model.support().model_declines["resume"]
    with pytest.raises(ValueNotAvailable, match=r"model\.resume is not available"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            resume_at(model, 2, torch.zeros(1))
    assert "resume" not in tiny_model("gemma3n_text_unshared").support().model_declines


def test_the_contributions_are_declined_naming_the_mixing(model):
    reason = model.support().reason("attention_output", layer=0)
    for part in ("AltUp", "LAuReL", "1/sqrt(2)", "per-layer-input"):
        assert part in reason
    with pytest.raises(ValueNotAvailable, match="AltUp"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            model.layers[0].mlp.mlp_output.save()


def test_the_twin_keeps_every_kind_of_block_of_a_full_size_config():
    """The default Gemma3nTextConfig (35 blocks, 15 sharing keys/values, 10 with activation sparsity, one
    MLP width per block): the twin keeps one block of each kind, with the sharing counted on its blocks."""
    from nncanon.families.gemma3n import _kv_sharing_modes
    from nncanon.proof.twin import build_twin

    built = build_twin(transformers.Gemma3nTextConfig(), model_class=transformers.Gemma3nForCausalLM,
                       blocks="model.layers")
    config = built.model.config
    assert built.stands_for == [0, 4, 10, 14, 18, 19, 20, 24, 34]
    assert _kv_sharing_modes(config) == [None] * 4 + ["store"] * 2 + ["reuse"] * 3  # (config.kv_sharing_modes)
    assert config.activation_sparsity_pattern == [0.95] * 2 + [0.0] * 7
    assert config.intermediate_size == [128] * 9
    assert json.dumps(config.layer_types).count("full_attention") == 5


def test_a_full_size_multimodal_config_is_proved_on_its_twin(monkeypatch):
    """The default Gemma3nConfig (the E-model's 35 text blocks, its audio and vision configs): the load-time
    proof builds a twin of the multimodal class (its vision tower left out where timm is missing) and proves
    every value the family serves on it."""
    from nncanon.proof.load import prove

    _multimodal(monkeypatch)  # the vision tower's stand-in, where timm is missing
    family = nncanon.families.REGISTRY["gemma3n"]
    proof = prove(transformers.Gemma3nConfig(), family, transformers.Gemma3nForConditionalGeneration, "always")
    failed = [r.describe() for r in proof.verdict.results if not r.passed]
    assert not failed, "\n".join(failed)
