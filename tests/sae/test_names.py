"""The name table: TransformerLens hook names, nncanon values and module paths as points of a model."""

from __future__ import annotations

import pytest
import torch

from nncanon import InvalidLayer, UnknownHookName, ValueNotAvailable
from nncanon.sae import Point, resolve, value_at
from nncanon.testing import PROMPTS, tiny_model

from ..conftest import skip_unavailable


def test_transformer_lens_names_on_a_sequential_block(gpt2):
    table = {
        "blocks.1.hook_resid_pre": "layer_input", "blocks.1.hook_resid_post": "layer_output",
        "blocks.1.hook_resid_mid": "resid_mid", "blocks.1.hook_attn_out": "attention_output",
        "blocks.1.hook_mlp_out": "mlp_output", "blocks.1.hook_mlp_in": "resid_mid",
        "blocks.1.ln2.hook_normalized": "mlp_normalized", "blocks.1.mlp.hook_in": "mlp_input",
        "blocks.1.ln1.hook_normalized": "attention_normalized", "blocks.1.attn.hook_z": "attention_head_outputs",
        "blocks.1.attn.hook_q": "query_states", "blocks.1.attn.hook_k": "key_states",
        "blocks.1.attn.hook_v": "value_states", "blocks.1.attn.hook_pattern": "attention_probabilities",
        "layers.1.layer_output": "layer_output", "layers[1].self_attn.attention_output": "attention_output",
        "transformer.h.1": "layer_output", "transformer.h.1.mlp": "mlp_output",
        "blocks.-1.hook_resid_post": "layer_output",
    }
    for name, value in table.items():
        point = resolve(gpt2, name)
        assert (point.layer, point.value) == (1, value), name
    # GPT-2 has no rotary embedding: its hook_q is the kernel's query, and it has no hook_rot_q
    with pytest.raises(ValueNotAvailable, match="applies no rotary embedding"):
        resolve(gpt2, "blocks.0.attn.hook_rot_q")


def test_rotary_queries_are_hook_rot_q(llama):
    assert resolve(llama, "blocks.0.attn.hook_rot_q").value == "query_states"
    with pytest.raises(ValueNotAvailable, match="before the rotary embedding"):
        resolve(llama, "blocks.0.attn.hook_q")
    assert resolve(llama, "model.layers.0.mlp").value == "mlp_output"


def test_names_without_a_meaning_here_say_why(llama):
    with pytest.raises(UnknownHookName, match="names no point"):
        resolve(llama, "encoder.blocks.0")
    with pytest.raises(UnknownHookName, match="not a TransformerLens hook name nncanon knows"):
        resolve(llama, "blocks.0.hook_everything")
    with pytest.raises(InvalidLayer, match="this model has 2 layers"):
        resolve(llama, "blocks.7.hook_resid_post")
    assert resolve(llama, "blocks.0.mlp.hook_post").value == "neurons"
    assert resolve(llama, "blocks.0.attn.hook_attn_scores").value == "attention_scores"
    assert resolve(llama, "hook_embed").label == "model.token_embeddings"
    with pytest.raises(ValueNotAvailable, match="rotary embedding of the queries and keys"):
        resolve(llama, "hook_pos_embed")


def test_a_parallel_block_has_no_resid_mid_and_its_mlp_in_is_the_block_input():
    skip_unavailable("gptj")
    model = tiny_model("gptj")
    with pytest.raises(ValueNotAvailable, match="parallel block"):
        resolve(model, "blocks.0.hook_resid_mid")
    assert resolve(model, "blocks.0.hook_mlp_in").value == "layer_input"


def test_a_deltanet_block_has_no_hook_z_and_its_attn_out_is_the_mixer():
    skip_unavailable("qwen3_next")
    model = tiny_model("qwen3_next")
    linear = next(i for i in range(model.num_layers) if model.support().available("linear_attn", layer=i))
    with pytest.raises(ValueNotAvailable, match="no softmax attention"):
        resolve(model, f"blocks.{linear}.attn.hook_z")
    assert resolve(model, f"blocks.{linear}.hook_attn_out").value == "linear_attention_output"
    assert resolve(model, f"blocks.{linear}.hook_resid_mid").parts == ("layer_input", "linear_attention_output")


def test_a_module_whose_output_is_not_the_contribution_is_refused():
    skip_unavailable("gemma2")
    model = tiny_model("gemma2")  # its MLP's output is normed before it is added
    with pytest.raises(ValueNotAvailable, match="not one of the standard values as it stands"):
        resolve(model, "model.layers.0.mlp")


def test_value_at_reads_what_the_surface_serves(gpt2):
    mid = resolve(gpt2, "blocks.1.hook_resid_mid")
    with torch.no_grad(), gpt2.trace(PROMPTS[0]):
        entering = gpt2.layers[1].layer_input.clone().save()
        heads = value_at(gpt2, "blocks.1.attn.hook_z").save()
        attention = gpt2.layers[1].self_attn.attention_output.clone().save()
        post = value_at(gpt2, "transformer.h.1").save()
    with torch.no_grad(), gpt2.trace(PROMPTS[0]):
        read_mid = value_at(gpt2, mid).save()
    assert torch.equal(read_mid, entering + attention)
    with torch.no_grad(), gpt2.trace(PROMPTS[0]):
        served_heads = gpt2.layers[1].self_attn.attention_head_outputs.save()
        served = gpt2.layers[1].layer_output.save()
    assert torch.equal(heads, served_heads) and heads.shape[-2:] == (gpt2.num_heads, gpt2.head_dim)
    assert torch.equal(post, served)


def test_an_edit_of_resid_mid_reaches_the_model_through_the_contribution(gpt2):
    mid = resolve(gpt2, "blocks.1.hook_resid_mid")
    shift = torch.linspace(-1, 1, gpt2.hidden_size)
    with torch.no_grad(), gpt2.trace(PROMPTS[0]):
        value_at(gpt2, mid)[:, -1] += shift
        through_mid = gpt2.logits.save()
    with torch.no_grad(), gpt2.trace(PROMPTS[0]):
        gpt2.layers[1].self_attn.attention_output[:, -1] += shift
        through_attention = gpt2.logits.save()
    assert torch.equal(through_mid, through_attention)


def test_a_probe_inside_a_trace_is_refused_by_name():
    model = tiny_model("llama")
    with pytest.raises(Exception, match="resolve the name before the trace"):
        with model.trace(PROMPTS[0]):
            value_at(model, "blocks.0.hook_resid_mid")
    assert Point(0, "layer_output").label == "layers[0].layer_output"


def test_hook_result_is_read_only_and_no_dictionary_attaches_there(gpt2):
    """``attn.hook_result`` (refused before): each head's output through its slice of GPT-2's ``c_proj`` (a Conv1D),
    summing to the attention's output less the projection's bias; computed from ``hook_z``, so an edit of it is
    InvalidWrite and a dictionary there is refused at attach."""
    from nncanon import DictionaryMismatch, InvalidWrite
    from nncanon.sae import Dictionary, attach

    assert resolve(gpt2, "blocks.1.attn.hook_result").value == "attention_head_contributions"
    attention = gpt2._module.transformer.h[1].attn
    with torch.no_grad(), gpt2.trace(PROMPTS[0]):
        result = value_at(gpt2, "blocks.1.attn.hook_result").save()
        z = value_at(gpt2, "blocks.1.attn.hook_z").save()
        out = gpt2.layers[1].self_attn.attention_output.save()
    w = attention.c_proj.weight.view(gpt2.num_heads, -1, gpt2.hidden_size)  # Conv1D: [in, out]
    torch.testing.assert_close(result, torch.einsum("bshk,hkd->bshd", z, w), rtol=0, atol=1e-6)
    torch.testing.assert_close(result.sum(-2) + attention.c_proj.bias, out, rtol=0, atol=1e-5)
    with pytest.raises(InvalidWrite, match="hook_result is read-only"), torch.no_grad(), gpt2.trace(PROMPTS[0]):
        value_at(gpt2, "blocks.1.attn.hook_result")[..., 0, :] = 0
        gpt2.logits.save()
    d = gpt2.hidden_size
    sae = Dictionary.from_tensors(torch.zeros(d, 4), None, torch.zeros(4, d), None,
                                  hook_name="blocks.1.attn.hook_result", hook_head_index=0)
    with pytest.raises(DictionaryMismatch, match="read-only"):
        attach(gpt2, sae)
