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

from nncanon import StandardizedTransformer, ValueNotAvailable
from nncanon.proof.checks import encode
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
        from nncanon.tools.resume import resume_at

        with model.trace(PROMPTS[0]):
            resume_at(model, last, entering)
