"""Mixture-of-experts values, on every registered family with an MoE layer.

- the routing values have the documented shapes and agree with each other;
- a router logit set to -inf removes that expert from exactly the tokens routed to it, and
  leaves every other token's choice of experts unchanged (a write changes the routing); on a router that
  chooses by more than the logits (a selection bias, groups), the masked expert carries weight 0 wherever it
  keeps a slot, shown with its bias raised as a trained checkpoint's can be;
- ``mlp_output`` equals the routed experts run independently on the MLP's input with the served
  indices and weights, plus the shared expert's output.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

from nncanon.proof.checks.routing import check_routing, choice_beyond_logits, selection_biases
from nncanon.testing import PROMPTS

from ..conftest import hf_block, upstream_failures


def _moe_layers(model) -> list[int]:
    return model.support().layers_with("router_logits")


def test_family_with_experts_has_an_moe_layer(model):
    """A configuration whose blocks have experts serves their routing (a family's other variants may
    have none: GraniteMoeHybrid without experts)."""
    config = model._text_config
    declares = any(model.family.for_layer(config, i)[0].router_logits is not None for i in range(model.num_layers))
    assert bool(_moe_layers(model)) == declares


def _routed_layers(model) -> list[int]:
    """Layers that serve the chosen experts (a router whose logits no write can reroute declines them:
    Kolibri-1)."""
    return model.support().layers_with("expert_indices")


def test_routing_values_agree(model):
    report = model.support()
    for index in _routed_layers(model):
        mlp = model.layers[index].mlp
        # A router with no [tokens, k] weights tensor (Llama-4) declines them, with the reason.
        has_weights = report.available("expert_weights", layer=index)
        has_logits = report.available("router_logits", layer=index)
        weights = logits = None
        with torch.no_grad(), model.trace(PROMPTS[0]):
            x = model.layers[index].layer_input.save()
            if has_logits:
                logits = mlp.router_logits.save()
            indices = mlp.expert_indices.save()  # before the weights: JetMoE softmaxes after its top-k
            if has_weights:
                weights = mlp.expert_weights.save()
        batch, seq = x.shape[:2]
        assert logits is None or logits.shape[:2] == (batch, seq)
        assert weights is None or weights.shape == indices.shape
        assert indices.shape[:2] == (batch, seq) and indices.dtype == torch.long
        assert logits is None or int(indices.max()) < logits.shape[-1]
        # Each token's chosen experts are distinct.
        assert all(len(set(row.tolist())) == len(row) for row in indices.reshape(-1, indices.shape[-1]))


@contextmanager
def _raised(biases: list[torch.Tensor], expert: int):
    """``expert``'s selection bias raised far above every score (as a trained checkpoint's can be), then restored."""
    kept = [bias.detach().clone() for bias in biases]
    try:
        with torch.no_grad():
            for bias in biases:
                bias[..., expert] += 100.0
        yield
    finally:
        with torch.no_grad():
            for bias, value in zip(biases, kept, strict=True):
                bias.copy_(value)


def test_masking_an_expert_takes_its_output_out_of_every_token(model):
    """A plain top-k router: the masked expert is chosen by no token and the others keep their experts. A router
    that chooses by more than the logits (a selection bias, groups): wherever the masked expert keeps a slot, its
    weight is 0, shown with its selection bias raised so that it keeps one on every token."""
    report = model.support()
    for index in _moe_layers(model):
        mlp = model.layers[index].mlp
        with torch.no_grad(), model.trace(PROMPTS[0]):
            before = mlp.expert_indices.save()
        expert = int(before.flatten()[0])
        routed = (before == expert).any(-1)
        assert routed.any()
        beyond = choice_beyond_logits(model, index)
        biases = list(selection_biases(model, index).values())
        weights = None
        with _raised(biases, expert), torch.no_grad(), model.trace(PROMPTS[0]):
            mlp.router_logits[..., expert] = float("-inf")
            after = mlp.expert_indices.save()
            if report.available("expert_weights", layer=index):
                weights = mlp.expert_weights.save()
        kept = after == expert
        if beyond is None:
            assert not kept.any(), "the masked expert is chosen by no token"
            assert torch.equal(after[~routed], before[~routed]), "tokens not routed to it keep their experts"
            continue
        assert weights is not None, f"{beyond}: the weights show that a kept expert carries nothing"
        assert torch.equal(weights[kept], torch.zeros_like(weights[kept])), f"{beyond}: a kept slot weighs 0"
        if biases:
            assert kept.any(-1).all(), f"{beyond} raised: the masked expert keeps a slot on every token"


def test_the_routing_check_holds_where_a_trained_checkpoints_bias_keeps_a_masked_expert(model):
    """The load-time check proves what holds on a trained checkpoint, not what a twin's small random biases show
    (transformers 5.21's default ERNIE-4.5-MoE twin kept a masked expert, and the check made for plain routers
    declined its routing)."""
    biased = {index: list(selection_biases(model, index).values()) for index in _moe_layers(model)}
    biased = {index: biases for index, biases in biased.items() if biases}
    chosen = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for index in biased:
            chosen[index] = model.layers[index].mlp.expert_indices.save()
    with ExitStack() as raised:  # (every biased layer's first chosen expert at once: one run of the check)
        for index, biases in biased.items():
            raised.enter_context(_raised(biases, int(chosen[index].flatten()[0])))
        results = [result for result in check_routing(model) if result.layer in biased]
    assert bool(results) == bool(biased) and all(result.passed for result in results), [r.note for r in results]


def _default_routed(moe, hidden, indices, weights, logits, config):
    """The routed experts, run on the MLP's (flattened) input with the served indices and weights."""
    return moe.experts(hidden, indices, weights)


def _llama4_routed(moe, hidden, indices, weights, logits, config):
    """Llama-4 runs every expert on its input scaled by sigmoid(logit) (zero where not chosen) and sums them."""
    scores = torch.full_like(logits, float("-inf")).scatter(1, indices, logits.gather(1, indices)).sigmoid()
    experts = scores.shape[1]
    outputs = moe.experts(hidden.repeat(experts, 1) * scores.T.reshape(-1, 1))
    return outputs.view(experts, -1, outputs.shape[-1]).sum(0)


def _jetmoe_routed(moe, hidden, indices, weights, logits, config):
    """JetMoE's experts are slices of two parallel linears (GLU), plus the MoE's output bias."""
    out = torch.zeros_like(hidden) + moe.bias
    for slot in range(indices.shape[-1]):
        for expert in indices[:, slot].unique().tolist():
            rows = indices[:, slot] == expert
            gate, up = (hidden[rows] @ moe.input_linear.weight[expert].T).chunk(2, dim=-1)
            part = (moe.activation(gate) * up) @ moe.output_linear.weight[expert].T
            out[rows] += weights[rows, slot, None] * part
    return out


def _longcat_routed(moe, hidden, indices, weights, logits, config):
    """LongCat-Flash's routed part, each chosen expert run on its own: a GLU expert of ``moe.experts`` for
    an index below ``n_routed_experts``, else a zero-computation expert returning its input (the experts
    module runs these itself before transformers 5.25, the MoE around it from 5.25)."""
    experts, out = moe.experts, torch.zeros_like(hidden)
    for slot in range(indices.shape[-1]):
        for expert in indices[:, slot].unique().tolist():
            rows = indices[:, slot] == expert
            if expert >= config.n_routed_experts:
                part = hidden[rows]
            else:
                gate, up = torch.nn.functional.linear(hidden[rows], experts.gate_up_proj[expert]).chunk(2, dim=-1)
                part = torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[expert])
            out[rows] += weights[rows, slot, None] * part
    return out


def _scaled(attribute):
    """The routed sum times a config factor the MoE applies outside its experts (Laguna)."""

    def routed(moe, hidden, indices, weights, logits, config):
        return getattr(config, attribute) * moe.experts(hidden, indices, weights)

    return routed


#: How a family's MoE turns the served routing into its routed part, where it is not `_default_routed`.
ROUTED = {
    "llama4": _llama4_routed,
    "jetmoe": _jetmoe_routed,
    "longcat_flash": _longcat_routed,
    "laguna": _scaled("moe_routed_scaling_factor"),
    "minimax_m3": _scaled("routed_scaling_factor"),
    "beam": _scaled("routed_scaling_factor"),
}


def _mean(routed, shared, moe, hidden, block, config):
    """Cohere2-MoE's default ``shared_expert_combination_strategy``: the mean of the routed and shared
    experts (the shared expert's part is then not its output: it is declined)."""
    if config.num_shared_experts == 0:
        return routed
    shared_raw = moe.shared_experts(hidden).view_as(routed)
    if config.shared_expert_combination_strategy == "average":
        return (routed + shared_raw) / 2
    return routed + shared


def _normed(path):
    """The routed plus shared experts through a norm, at ``path`` in the MoE or else in the block (the
    shared expert's part of a norm's output is not a term: it is declined)."""

    def combine(routed, shared, moe, hidden, block, config):
        if getattr(moe, "shared_experts", None) is not None:
            routed = routed + moe.shared_experts(hidden).view_as(routed)
        norm = getattr(moe, path) if hasattr(moe, path) else block.get_submodule(path)
        return norm(routed)

    return combine


def _raw_shared(routed, shared, moe, hidden, block, config):
    """The routed experts plus the shared expert's own output: the MoE module's output, where the block norms
    and gates it before it joins the stream (Ergo: the contribution and the shared part are declined)."""
    return routed + moe.shared_experts(hidden).view_as(routed)


def _after(path):
    """The routed plus shared experts through the block's module at ``path`` that follows the MoE
    (Inkling's short convolution ``mlp_sconv``, whose output is the contribution)."""

    def combine(routed, shared, moe, hidden, block, config):
        return block.get_submodule(path)(routed + (shared if shared is not None else 0))

    return combine


#: How a family combines the routed part and the shared expert into ``mlp_output``, where it is not
#: ``routed + shared_expert_output``.
COMBINED = {
    "cohere2_moe": _mean,
    "axk1": _normed("post_mlp_layernorm"),
    "flex_olmo": _normed("post_feedforward_layernorm"),
    "afmoe": _normed("post_mlp_layernorm"),
    "kolibri1": _normed("post_mlp_layernorm"),
    "kolibri1_1": _normed("post_mlp_layernorm"),
    "inkling": _after("mlp_sconv"),
    "ergo": _raw_shared,
}


def test_mlp_output_is_routed_plus_shared(model):
    """``mlp_output`` is recomputed from the served routing with the family's own experts.

    The reference runs the experts module (or, where a family's experts differ, the family's
    reference in `ROUTED`) on the MLP's input with the served indices and weights, and adds the
    served shared expert's output (or combines them as the family does: `COMBINED`).
    """
    config = model._text_config
    for index in _routed_layers(model):
        mlp = model.layers[index].mlp
        report = model.support()
        has_weights = report.available("expert_weights", layer=index)
        has_logits = report.available("router_logits", layer=index)
        # Where the MLP's contribution is declined (MiniMax: not additive) or is not the MoE's output
        # (Qwen4-Exp, HY-V4: the output written into hyper-connected streams), the routing is checked
        # against the MoE module's own output.
        site = mlp._nncanon.bindings["mlp_output"].site
        contribution = report.available("mlp_output", layer=index) and not site.merge and site.weighted is None
        weights = logits = None  # assigned inside the trace only where served (a None set there does not come back)
        with torch.no_grad(), model.trace(PROMPTS[0]):
            hidden = mlp.input.save()
            if has_logits:
                logits = mlp.router_logits.save()
            indices = mlp.expert_indices.save()  # before the weights: JetMoE softmaxes after its top-k
            if has_weights:
                weights = mlp.expert_weights.save()
            output = mlp.mlp_output.save() if contribution else mlp.output.save()
        if isinstance(output, tuple):  # an MoE that also returns a state for the next block (ZAYA's router)
            output = output[0]
        shared = None
        if report.available("shared_expert_output", layer=index):
            # Its own trace: some MoEs run the shared expert before the router, others after the experts.
            with torch.no_grad(), model.trace(PROMPTS[0]):
                shared = mlp.shared_expert_output.save()
        block = hf_block(model, index)
        # The MoE module: the MLP component's own, else the module the contribution is read at (a
        # block that adds the routed and shared parts itself reads it at an operation of its forward).
        moe = getattr(mlp, "_module", None)
        if not hasattr(moe, "experts") and not hasattr(moe, "input_linear"):
            moe = block.get_submodule(site.module)
        # A family that scales the MLP's contribution (GraniteMoeHybrid's residual_multiplier) scales
        # the routed part too; the shared part is served as it reaches the stream.
        factor = site.factor(config) if contribution else 1.0
        flat = hidden.reshape(-1, hidden.shape[-1])
        top_k = indices.shape[-1]
        routed_of = ROUTED.get(model.family.name, _default_routed)
        with torch.no_grad():
            routed = routed_of(
                moe,
                flat,
                indices.reshape(-1, top_k),
                weights.reshape(-1, top_k) if weights is not None else None,
                logits.reshape(-1, logits.shape[-1]) if logits is not None else None,
                config,
            ).reshape(output.shape)
            combine = COMBINED.get(model.family.name)
            if combine is None:
                expected = factor * routed + (shared if shared is not None else 0)
            else:
                expected = combine(routed, shared, moe, flat, block, config)
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


def test_moe_write_in_one_invoke_touches_its_rows_only(model, variant):
    """A write to a routing value or the shared expert in one invoke leaves the other invokes bit-identical.

    These values are read on the flattened tokens of the whole batch (or copied, Llama-4's shared
    expert), so a write must go back into this invoke's rows only. Compared with the same batch
    without the write; each value in its own trace (the families run them in different orders).
    """
    report = model.support()
    # Where the installed transformers' own forward gives NaN on padded positions (the record's upstream
    # failures: Qwen4-Exp on 5.20-5.22), those positions must be NaN in both runs.
    same = dict(rtol=0, atol=1e-6, equal_nan=bool(upstream_failures(variant)))
    for index in _routed_layers(model)[:1]:
        for name in ("router_logits", "expert_weights", "shared_expert_output"):
            if not report.available(name, layer=index):
                continue
            runs = {}
            for write in (False, True):
                with torch.no_grad(), model.trace() as tracer:
                    with tracer.invoke(PROMPTS[0]):
                        first = model.logits.save()
                    with tracer.invoke(PROMPTS[0]):
                        value = getattr(model.layers[index].mlp, name)
                        if write:
                            value[:, -1] = value[:, -1] * 0.5
                        middle = model.logits.save()
                    with tracer.invoke(PROMPTS[1]):
                        last = model.logits.save()
                runs[write] = (first, middle, last)
            # Rerouting invoke 2's tokens changes each expert's batch of rows, which moves the other rows at
            # the last bit (as in test_invariants); a leaked write would move them by far more.
            torch.testing.assert_close(runs[True][0], runs[False][0], **same, msg=f"{name}: invoke 1 moved")
            torch.testing.assert_close(runs[True][2], runs[False][2], **same, msg=f"{name}: invoke 3 moved")
            if name != "router_logits":  # halving a logit may leave the top-k as it was
                assert not torch.equal(runs[True][1], runs[False][1]), f"{name}: the write must reach its invoke"
