"""Blocks the model does not run on text alone (`Family.idle`): Mllama's cross-attention decoder layers.

``MllamaTextModel`` does not call a cross-attention layer without ``cross_attention_states``: the stream
passes it unchanged. nncanon keeps the model's block list (``layers[i]`` is the model's block ``i``); an
idle block serves ``layer_input`` and ``layer_output`` as the stream passing it and no component, and the
verifier proves both against plain hooks. These tests run the surface across idle blocks in several
positions (between blocks, first, last, two in a row) against the plain transformers model.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from nncanon import InvalidInput, StandardizedTransformer, ValueNotAvailable
from nncanon.proof.checks.references import encode
from nncanon.proof.verdict import verify
from nncanon.registry import variant
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_model, tiny_tokenizer

from .conftest import skip_unavailable

#: Positions of the cross-attention layers among 4 blocks: between blocks, first, last, two in a row.
LAYOUTS = {"between": [1], "first": [0], "last": [3], "two": [1, 2]}


def _text_config(cross: list[int]) -> dict:
    return {**variant("mllama").config["text_config"], "cross_attention_layers": cross}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    skip_unavailable("mllama")
    cross = LAYOUTS[request.param]
    return cross, tiny_model("mllama", text_config=_text_config(cross)), tiny_hf_model(
        "mllama", text_config=_text_config(cross))


def _hooked_streams(hf, inputs) -> tuple[dict, dict]:
    """Each block's input and output by plain hooks (blocks the model does not call are absent)."""
    entering, leaving = {}, {}
    handles = []
    for index, block in enumerate(hf.model.layers):
        handles.append(block.register_forward_pre_hook(
            lambda m, args, kwargs, index=index: entering.__setitem__(index, args[0] if args else kwargs[
                "hidden_states"]), with_kwargs=True))
        handles.append(block.register_forward_hook(lambda m, a, out, index=index: leaving.__setitem__(index, out)))
    try:
        with torch.no_grad():
            hf(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return entering, leaving


def test_every_check_holds_wherever_the_idle_blocks_are(layout):
    cross, model, _ = layout
    verdict = verify(model)
    assert verdict.passed, "\n".join(r.describe() for r in verdict.failed())
    for index in cross:
        assert verdict.proved(index, "layer_input") and verdict.proved(index, "layer_output")


def test_an_idle_block_serves_the_stream_passing_it_and_no_component(layout):
    cross, model, hf = layout
    entering, leaving = _hooked_streams(hf, encode(model))
    assert sorted(set(range(4)) - set(entering)) == cross, "transformers does not call the cross-attention layers"
    runs = [i for i in range(4) if i not in cross]
    saved = []
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for index in range(4):
            saved.append((model.layers[index].layer_input.save(), model.layers[index].layer_output.save()))
    for index in cross:
        after = [i for i in runs if i > index]
        stream = entering[after[0]] if after else leaving[max(runs)]
        assert torch.equal(saved[index][0], stream) and torch.equal(saved[index][1], stream)
    report = model.support()
    for index in cross:
        assert report.layers[index].block_type == "MllamaCrossAttentionDecoderLayer"
        for component in ("self_attn", "linear_attn", "mlp"):
            reason = report.reason(component, index)
            assert reason.startswith(f"layers[{index}] (MllamaCrossAttentionDecoderLayer) does not run: ")
            assert "cross_attention_states" in reason
            with pytest.raises(ValueNotAvailable, match=r"does not run"):
                getattr(model.layers[index], component)
    assert report.declined() == []


def test_a_write_to_an_idle_block_is_a_write_to_the_stream_passing_it(layout):
    """``layers[i].layer_output += v`` on an idle block equals the plain model with ``v`` added to the
    stream where it enters the next block that runs (or leaves the last one)."""
    cross, model, hf = layout
    index = cross[-1]
    runs = [i for i in range(4) if i not in cross]
    after = [i for i in runs if i > index]
    vector = torch.linspace(-1, 1, model.hidden_size)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.layers[index].layer_output[:, 2] += vector
        logits = model.logits.save()
    if after:
        def add(module, args, kwargs):
            args[0][:, 2] += vector
        handle = hf.model.layers[after[0]].register_forward_pre_hook(add, with_kwargs=True)
    else:
        def add(module, args, output):
            output[:, 2] += vector
        handle = hf.model.layers[max(runs)].register_forward_hook(add)
    try:
        with torch.no_grad():
            expected = hf(**encode(model)).logits
    finally:
        handle.remove()
    assert torch.equal(logits, expected)


def test_skips_and_the_lens_pass_over_idle_blocks(layout):
    cross, model, _ = layout
    for start in range(4):
        for end in range(start, 4):
            with torch.no_grad(), model.trace(PROMPTS[0]):
                entering = model.layers[start].layer_input.save()
                model.skip_layers(start, end)
                leaving = model.layers[end].layer_output.save()
            assert torch.equal(entering, leaving), (start, end)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.skip_layers(cross[0])  # the block does not run anyway: nothing changes
        skipped = model.logits.save()
    lens: list = []  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for index in range(4):
            lens.append(model.project_on_vocab(model.layers[index].layer_output).save())
        clean = model.logits.save()
    assert torch.equal(skipped, clean)
    assert torch.equal(lens[-1], clean)
    for index in cross:
        if index > 0:
            assert torch.equal(lens[index], lens[index - 1])


def test_resuming_at_an_idle_block_is_the_forward(layout):
    from nncanon.resuming import resume_at, streams_entering

    _, model, _ = layout
    streams = streams_entering(model, PROMPTS[0], list(range(4)))
    with torch.no_grad(), model.trace(PROMPTS[0]):
        whole = model.logits.save()
    for layer in range(4):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            resume_at(model, layer, streams[layer])
            resumed = model.logits.save()
        assert torch.equal(resumed, whole), layer


def test_image_states_are_refused_by_name():
    skip_unavailable("mllama")
    model = tiny_model("mllama")
    states = torch.zeros(1, 4, model.hidden_size)
    expected = r"given cross_attention_states: with it the model runs blocks \[1\].*serves the text path"
    with pytest.raises(InvalidInput, match=expected):
        with model.trace(PROMPTS[0], cross_attention_states=states):
            model.logits.save()
    with pytest.raises(InvalidInput, match=expected):
        with model.generate(PROMPTS[0], max_new_tokens=2, cross_attention_states=states):
            pass


def test_an_mllama_checkpoint_loads_its_text_model_proved(tmp_path):
    """A Llama-3.2-Vision checkpoint (``MllamaForConditionalGeneration``, model_type ``mllama``) loads as its
    causal LM, ``MllamaForCausalLM`` on the text config, proved at load on a twin; logits equal
    transformers' own causal LM of the folder, and generation runs on text."""
    skip_unavailable("mllama")
    config = variant("mllama").build_config()
    torch.manual_seed(0)
    transformers.MllamaForConditionalGeneration(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model = StandardizedTransformer(str(tmp_path), attn_implementation="eager", verify="always")
    assert model._text_config.model_type == "mllama_text_model"
    report = model.support()
    assert report.provenance.startswith("proved on a twin of this config")
    assert report.available("layer_output", 1) and not report.available("mlp", 1)
    assert report.layers_with("mlp_output") == [0, 2, 3]
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        logits = model.logits.save()
    with torch.no_grad():
        assert torch.equal(logits, plain(**encode(model)).logits)
    with torch.no_grad(), model.generate(PROMPTS[0], max_new_tokens=3, do_sample=False) as tracer:
        ids = tracer.result.save()
    with torch.no_grad():
        expected = plain.generate(**encode(model), max_new_tokens=3, do_sample=False)
    assert torch.equal(ids, expected)
