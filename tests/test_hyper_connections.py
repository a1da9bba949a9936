"""Hyper-connection streams the model keeps as ``[b, s, k, d]`` (HY-V4, DeepSeek-V4), served ``[b, s, k·d]`` like
every multi-stream family's: the per-stream writes (`Site.weighted`, merged).

A sublayer's write ``post ⊗ out`` is no operation of the model: nncanon takes it over (the weight is handed
to the model as zeros and the product added to the streams). These tests check that taking it over is
invisible, bit for bit (fp32 and bf16), that a write is exactly what reaches the streams, and that
DeepSeek-V4's attention, mixed by ``comb`` before it reaches ``layer_output``, is declined with that reason.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nncanon import InvalidWrite, StandardizedTransformer, ValueNotAvailable
from nncanon.proof.checks.references import encode
from nncanon.testing import PROMPTS, tiny_model

from .conftest import skip_unavailable

WEIGHTED = {"hy_v4": ("attention_output", "mlp_output"), "deepseek_v4": ("mlp_output",)}


def _component(model, layer: int, name: str):
    block = model.layers[layer]
    return block.self_attn if name == "attention_output" else block.mlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(WEIGHTED))
def test_reading_a_per_stream_write_leaves_the_model_bit_identical(name, dtype):
    skip_unavailable(name)
    model = tiny_model(name)
    if dtype != torch.float32:
        module = copy.deepcopy(model._module).to(dtype)
        model = StandardizedTransformer(module, tokenizer=model.tokenizer, verify="never", family=model.family)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for layer in range(model.num_layers):
            for value in WEIGHTED[name]:
                getattr(_component(model, layer, value), value).save()
        read = model.logits.save()
    assert torch.equal(read, clean)


def test_a_per_stream_write_is_exactly_what_reaches_the_streams():
    """HY-V4: the streams after attention are ``layer_input + attention_output`` as the model adds them, with
    the written value in place of the model's, bit for bit."""
    skip_unavailable("hy_v4")
    model = tiny_model("hy_v4")
    layer = model.layers[1]
    tokens = encode(model)["input_ids"].shape[1]
    k, d = model._text_config.hc_mult, model.hidden_size
    written = torch.randn(1, tokens, k * d)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        x = layer.layer_input.save()
        layer.self_attn.attention_output = written
        streams = layer.ffn_hc.input.save()  # the model's own [b, s, k, d]
    assert x.shape == written.shape
    assert torch.equal(streams, (x + written).view(1, tokens, k, d))
    # the model's own [b, s, k, d] is not the served layout: refused, naming the shape it expects
    with pytest.raises(InvalidWrite, match=rf"expects shape \(1, {tokens}, {k * d}\)"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            layer.self_attn.attention_output = written.view(1, tokens, k, d)


def test_deepseek_v4_declines_attention_naming_the_comb_mixing():
    skip_unavailable("deepseek_v4")
    model = tiny_model("deepseek_v4")
    reason = model.support().reason("attention_output", 1)
    assert "comb" in reason and "mixing" in reason
    with pytest.raises(ValueNotAvailable, match=r"layers\[1\]\.self_attn\.attention_output is not available.*comb"):
        with model.trace(PROMPTS[0]):
            model.layers[1].self_attn.attention_output.save()
    # its MLP's write is served, [b, s, k·d] like the streams, and moves layer_output by exactly itself
    with torch.no_grad(), model.trace(PROMPTS[0]):
        mlp = model.layers[1].mlp.mlp_output.save()
        y = model.layers[1].layer_output.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.layers[1].mlp.mlp_output = torch.zeros_like(mlp)
        ablated = model.layers[1].layer_output.save()
    assert mlp.shape == y.shape and mlp.shape[2] == model._text_config.hc_mult * model.hidden_size
    torch.testing.assert_close(y - ablated, mlp, rtol=1e-5, atol=1e-6)


def test_hy_v4_skip_of_a_shared_indexer_block_hands_on_the_picks_it_was_given():
    """HY-V4's blocks return their indexer's top-k picks; a skipped block hands on those it was given, so a skip
    of the last block (a ``"shared"`` one) runs, and its logits are the lens of the stream entering it."""
    skip_unavailable("hy_v4")
    model = tiny_model("hy_v4")
    last = model.num_layers - 1
    assert model._text_config.indexer_types[last] == "shared"
    with torch.no_grad(), model.trace(PROMPTS[0]):
        entering = model.layers[last].layer_input.save()
        model.skip_layers(last, last)
        leaving = model.layers[last].layer_output.save()
        logits = model.logits.save()
    assert torch.equal(leaving, entering)
    assert torch.equal(model.project_on_vocab(entering), logits)
    with pytest.raises(ValueNotAvailable, match=r"model\.resume is not available: a block whose indexer is 'shared'"):
        from nncanon.resuming import resume_at

        with model.trace(PROMPTS[0]):
            resume_at(model, last, entering)


STREAMS = {"qwen4_exp_text": "hc_count", "gemma3n_text_unshared": "altup_num_inputs", "hy_v4": "hc_mult",
           "deepseek_v4": "hc_mult"}


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_every_multi_stream_family_serves_one_layout(name):
    """``layer_input``, ``layer_output`` and every served contribution are ``[b, s, k·d]`` on each multi-stream
    family, whatever the model's own tensor (``[b, s, k·d]``, ``[b, s, k, d]``, ``[k, b, s, d]``), and
    ``project_on_vocab`` of the last block's output in that layout is the model's logits."""
    skip_unavailable(name)
    model = tiny_model(name)
    k, d = getattr(model._text_config, STREAMS[name]), model.hidden_size
    tokens = encode(model)["input_ids"].shape[1]
    served = model.support()
    last = model.num_layers - 1
    streams, parts = [], []
    with torch.no_grad(), model.trace(PROMPTS[0]):
        streams.append(model.layers[0].layer_input.save())
        if served.reason("mlp_output", 0) is None:
            parts.append(model.layers[0].mlp.mlp_output.save())
        streams.append(model.layers[last].layer_output.save())
        logits = model.logits.save()
    assert (name == "gemma3n_text_unshared") == (not parts)  # AltUp declines its contributions
    assert all(tensor.shape == (1, tokens, k * d) for tensor in [*streams, *parts])
    assert torch.equal(model.project_on_vocab(streams[1]), logits)


def test_a_write_to_the_merged_stream_reaches_the_models_own_streams():
    """DeepSeek-V4 keeps ``[b, s, k, d]``: an in-place edit of the served ``[b, s, k·d]`` view, an assignment, and
    a skip's replacement each reach the block's own tensor, element for element."""
    skip_unavailable("deepseek_v4")
    model = tiny_model("deepseek_v4")
    k, d = model._text_config.hc_mult, model.hidden_size
    tokens = encode(model)["input_ids"].shape[1]
    written = torch.randn(1, tokens, k * d)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.layers[1].layer_input[:, -1, d:] = 0  # stream 1 at the last position, in place
        edited = model.layers[1].attn_hc.input.save()  # the model's own [b, s, k, d]
        model.layers[1].layer_output = written
        assigned = model.layers[2].attn_hc.input.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        clean = model.layers[1].attn_hc.input.save()
    expected = clean.clone()
    expected[:, -1, 1] = 0
    assert torch.equal(edited, expected)
    assert torch.equal(assigned, written.view(1, tokens, k, d))
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.skip_layers(0, 0, skip_with=written)
        entering = model.layers[1].layer_input.save()
        raw = model.layers[1].attn_hc.input.save()
    assert torch.equal(entering, written) and torch.equal(raw, written.view(1, tokens, k, d))
