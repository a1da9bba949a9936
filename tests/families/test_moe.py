"""Mixture-of-experts values, on every registered family with an MoE layer.

- the routing values have the documented shapes and agree with each other;
- a router logit set to -inf removes that expert from exactly the tokens routed to it, and
  leaves every other token's choice of experts unchanged (a write changes the routing);
- ``mlp_output`` equals the routed experts run independently on the MLP's input with the served
  indices and weights, plus the shared expert's output.
"""

from __future__ import annotations

import torch

from nncanon.testing import PROMPTS

from ..conftest import hf_block


def _moe_layers(model) -> list[int]:
    return model.support().layers_with("router_logits")


def test_family_with_experts_has_an_moe_layer(model):
    declares = any(layout.router_logits is not None for layout in model.family.all_layouts())
    assert bool(_moe_layers(model)) == declares


def test_routing_values_agree(model):
    for index in _moe_layers(model):
        mlp = model.layers[index].mlp
        with torch.no_grad(), model.trace(PROMPTS[0]):
            x = model.layers[index].layer_input.save()
            logits = mlp.router_logits.save()
            weights = mlp.expert_weights.save()
            indices = mlp.expert_indices.save()
        batch, seq = x.shape[:2]
        assert logits.shape[:2] == (batch, seq) and weights.shape == indices.shape
        assert indices.shape[:2] == (batch, seq) and indices.dtype == torch.long
        assert int(indices.max()) < logits.shape[-1]
        # Each token's chosen experts are distinct.
        assert all(len(set(row.tolist())) == len(row) for row in indices.reshape(-1, indices.shape[-1]))


def test_masking_an_expert_reroutes_exactly_its_tokens(model):
    for index in _moe_layers(model):
        mlp = model.layers[index].mlp
        with torch.no_grad(), model.trace(PROMPTS[0]):
            before = mlp.expert_indices.save()
        expert = int(before.flatten()[0])
        with torch.no_grad(), model.trace(PROMPTS[0]):
            mlp.router_logits[..., expert] = float("-inf")
            after = mlp.expert_indices.save()
        routed = (before == expert).any(-1)
        assert not (after == expert).any(), "the masked expert is chosen by no token"
        assert torch.equal(after[~routed], before[~routed]), "tokens not routed to it keep their experts"
        assert routed.any()


def test_mlp_output_is_routed_plus_shared(model):
    for index in _moe_layers(model):
        mlp = model.layers[index].mlp
        report = model.support()
        with torch.no_grad(), model.trace(PROMPTS[0]):
            hidden = mlp.input.save()
            weights = mlp.expert_weights.save()
            indices = mlp.expert_indices.save()
            shared = mlp.shared_expert_output.save() if report.available("shared_expert_output", layer=index) else None
            output = mlp.mlp_output.save()
        experts = hf_block(model, index).get_submodule(mlp._nncanon.bindings["mlp_output"].site.module).experts
        flat = hidden.reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            routed = experts(flat, indices.reshape(-1, indices.shape[-1]), weights.reshape(-1, weights.shape[-1]))
        expected = routed.view_as(output) + (shared if shared is not None else 0)
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
