"""Per-head contributions through the output projection sum to the projection's output."""

from __future__ import annotations

import torch

from nncanon.testing import PROMPTS
from nncanon.tools import attention_head_contributions, head_count, output_projection, projection_weights

from .conftest import attention_layers

TOL = dict(rtol=1e-5, atol=1e-6)


def test_heads_sum_to_the_projection_output(model):
    for layer in attention_layers(model):
        projection = output_projection(model, layer)
        seen = {}
        handle = projection.register_forward_hook(lambda m, a, out, seen=seen: seen.update(out=out.detach().clone()))
        try:
            with torch.no_grad(), model.trace(PROMPTS):
                per_head = attention_head_contributions(model, layer).save()
        finally:
            handle.remove()
        _, bias = projection_weights(model, layer)
        assert per_head.shape[-2:] == (head_count(model, layer), model.hidden_size)
        total = per_head.sum(-2) + (0 if bias is None else bias)
        torch.testing.assert_close(total, seen["out"].view_as(total), **TOL)


def test_heads_sum_to_attention_output_where_nothing_follows_the_projection(model):
    """Where attention_output is the projection's output (times the family's scale), the heads give it too."""
    first = attention_layers(model)[0]
    attention = model.layers[first].self_attn
    site = attention._nncanon.bindings["attention_output"].site
    relative = attention.path[len(model.layers[first].path) + 1 :]
    projection = attention._nncanon.bindings["attention_head_outputs"].site.module
    if site.module not in (relative, projection):
        return  # a post-norm follows (Gemma-2): covered by the projection test and the attribution tests
    scale = site.factor(model._module.config.get_text_config())
    for layer in attention_layers(model):
        with torch.no_grad(), model.trace(PROMPTS):
            per_head = attention_head_contributions(model, layer).save()
            attention_output = model.layers[layer].self_attn.attention_output.save()
        _, bias = projection_weights(model, layer)
        total = (per_head.sum(-2) + (0 if bias is None else bias)) * scale
        torch.testing.assert_close(total, attention_output, **TOL)


def test_conv1d_and_linear_weights_are_read_per_input(model):
    """W[h] maps head h's slice of the projection input: one-hot inputs recover the weight."""
    first = attention_layers(model)[0]
    projection = output_projection(model, first)
    weight, bias = projection_weights(model, first)
    heads = head_count(model, first)
    probe = torch.eye(heads * model.head_dim)
    with torch.no_grad():
        out = projection(probe) - (0 if bias is None else bias)
    torch.testing.assert_close(out.view(heads, model.head_dim, -1), weight, **TOL)


def test_heads_through_a_norm_over_all_heads():
    """BitNet norms all heads together before o_proj: each head goes through the norm as it ran, then its
    slice; the served heads are the norm's input (each head's own output)."""
    from nncanon.tools import direct_logit_attribution, head_norm

    from .conftest import build

    model = build("bitnet")
    assert type(head_norm(model, 0)).__name__ == "BitNetRMSNorm"
    assert type(output_projection(model, 0)).__name__ == "Linear"
    test_heads_sum_to_the_projection_output(model)
    test_conv1d_and_linear_weights_are_read_per_input(model)
    dla = direct_logit_attribution(model, PROMPTS, [5, 17])
    torch.testing.assert_close(dla.heads.sum(-1) + dla.head_bias, dla.attention, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dla.total(), dla.logit, rtol=1e-4, atol=1e-5)
