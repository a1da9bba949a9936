"""The MLP or mixture of experts: its contribution to the residual stream, and the routing."""

from __future__ import annotations

from typing import Any

from nnsight.intervention.envoy import Envoy

from ..served import served
from .base import Component, ComponentState
from .norms import norm_values


class MLPValues(Component):
    """The values of a block's MLP; on a mixture of experts also the router's."""

    role = "mlp"
    standard_values = ("mlp_norm_scale", "mlp_normalized", "router_logits", "expert_weights", "expert_indices",
                       "shared_expert_output", "pre_activations", "linear_activations", "neurons",
                       "mlp_post_norm_scale",
                       "mlp_output")
    # The norm before the MLP and its post-norm (`nncanon.components.norms`): mlp_norm_scale [b, s, 1], mlp_normalized
    # [b, s, d], mlp_post_norm_scale [b, s, 1].
    locals().update(norm_values("mlp"))

    router_logits = served(
        "router_logits",
        "router logits [b, s, num_experts]",
        "The router's logits, ``[batch, seq, num_experts]``, before the top-k; writable, and a write "
        "changes which experts each token is routed to.",
    )
    expert_weights = served(
        "expert_weights",
        "weights of the chosen experts [b, s, top_k]",
        "The weights the chosen experts' outputs are combined with, ``[batch, seq, top_k]``.",
    )
    expert_indices = served(
        "expert_indices",
        "indices of the chosen experts [b, s, top_k]",
        "The experts each token is routed to, ``[batch, seq, top_k]``.",
    )
    shared_expert_output = served(
        "shared_expert_output",
        "what the shared expert adds [b, s, d]",
        "The shared expert's part of the MLP output (after its gate, where it has one), ``[batch, seq, hidden]``.",
    )
    pre_activations = served(
        "pre_activations",
        "the MLP's pre-activations [b, s, d_mlp]",
        "What the MLP's activation function receives, ``[batch, seq, d_mlp]`` (TransformerLens ``mlp.hook_pre``; the "
        "gate path of a gated MLP). Writable: a write reaches the activation.",
    )
    linear_activations = served(
        "linear_activations",
        "the linear path of a gated MLP [b, s, d_mlp]",
        "The linear path a gated MLP multiplies the activation by, ``[batch, seq, d_mlp]`` (TransformerLens "
        "``mlp.hook_pre_linear``). Writable.",
    )
    neurons = served(
        "neurons",
        "the MLP's neurons: what its down projection receives [b, s, d_mlp]",
        "The MLP's hidden activations, exactly what its down projection receives, ``[batch, seq, d_mlp]`` "
        "(TransformerLens ``mlp.hook_post``): ``activation(pre_activations) · linear_activations``. Writable: "
        "``neurons[..., n] = 0`` ablates neuron ``n``.",
    )
    mlp_output = served(
        "mlp_output",
        "what the MLP adds to the residual stream [b, s, d]",
        "Exactly what the MLP (or the whole mixture of experts: routed plus shared) adds to the residual "
        "stream, ``[batch, seq, hidden]``: ``layer_input + attention_output + mlp_output == layer_output``. "
        "Writable.",
    )


class MLPEnvoy(MLPValues, Envoy):
    """A block's MLP or mixture of experts: ``model.layers[i].mlp``."""


class VirtualMLP(MLPValues):
    """``model.layers[i].mlp`` for a family whose MLP is not a module of its own (OPT).

    It serves ``mlp_output`` and the neurons from the modules the block runs inline; everything else about
    those modules is on the block (``model.layers[i].fc1``, ``.fc2``).
    """

    def __init__(self, state: ComponentState) -> None:
        self._nncanon = state

    def __getattr__(self, name: str) -> Any:
        if name in type(self).standard_values:
            self._nncanon_binding(name)
        raise AttributeError(
            f"{self._nncanon.where} is the MLP of a block that runs it inline, not a module: "
            f"it serves its standard values only ({', '.join(type(self).standard_values)}); the block's own modules "
            "hold the rest."
        )

    def __repr__(self) -> str:
        return f"VirtualMLP({self._nncanon.where}: {', '.join(sorted(self._nncanon.bindings))})"
