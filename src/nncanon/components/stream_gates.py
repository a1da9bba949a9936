"""The weights a hyper-connected block computes from its ``k`` residual streams (`nncanon.families.Family.
merged_streams`): what an attribution graph freezes so that the block, and the final collapse of the streams, are
linear in the streams.

A hyper-connection module reads the ``k`` streams ``[b, s, k, d]`` (or ``[b, s, k·d]``) and returns the mix of them a
sublayer reads (``pre``: a weight per stream; Qwen4-Exp's a weight per stream and channel, after a grouped RMS norm),
the weight of the sublayer's output in each stream (``post``, ``[b, s, k]``) and, on DeepSeek-V4, the ``k × k``
matrix that mixes the streams before the output is added (``comb``, Sinkhorn-normalised). Each is a sigmoid, a
softmax or a norm of the streams themselves; written back at the clean run's values (detached, through nnsight's
``.source`` and the module's call, as `nncanon.graphs.mixers` writes a linear mixer's gates), what is left is
linear: ``y = combᵀ·x + post ⊗ f(Σ pre·x)`` with ``f`` the sublayer. The final collapse (HY-V4's and DeepSeek-V4's
``hc_head``, Qwen4-Exp's ``hyper_connection_mixer``) is the same mix without an output.

`STREAM_GATES` maps a hyper-connection class to its frozen values (`nncanon.components.mixer_gates.Gate`, relative to
the module; a function of the module where its config leaves one out), `gates_of` gives a module's, `KINDS` says what
is frozen per family (for messages and docs).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .mixer_gates import Gate

#: What is frozen, per family of hyper-connections (for messages and docs).
KINDS = {
    "HY-V4": "pre (the streams' mix a sublayer reads: torch_sigmoid_0) and post (each stream's weight of the "
             "sublayer's output: the module's first output); the final collapse's pre",
    "DeepSeek-V4": "pre (torch_sigmoid_0), post and comb (the Sinkhorn-normalised k x k mix of the streams: the "
                   "module's first two outputs); the final collapse's pre",
    "Qwen4-Exp": "the grouped RMS norm's scale on the streams (hc_norm's rsqrt), the per-channel mix (torch_sigmoid_0) "
                 "and the injection weights (torch_sigmoid_1); the final collapse's norm scale and mix",
}

#: The module's own outputs ``post`` (HY-V4: ``(post, mixed)``) and ``(post, comb)`` (DeepSeek-V4:
#: ``(post, comb, mixed)``), after the mix ``pre`` (its sigmoid) is frozen.
_PRE = Gate("torch_sigmoid_0", "output")


def _qwen4(module: nn.Module) -> tuple[Gate, ...]:
    """Qwen4-Exp's gated residual: its grouped norm's scale, its mix and (a block's, not the final collapse's) its
    injection weights."""
    gates = (Gate("self__norm_0.torch_rsqrt_0", "output", module="hc_norm"), _PRE)
    return gates if module.block_inject_weight is None else (*gates, Gate("torch_sigmoid_1", "output"))


#: Per hyper-connection class: its frozen values in the order its forward computes them (or a function of the module).
STREAM_GATES: dict[str, tuple[Gate, ...] | Callable[[nn.Module], tuple[Gate, ...]]] = {
    "HYV4HyperConnection": (_PRE, Gate(None, "output", (0,))),
    "HYV4HyperHead": (_PRE,),
    "DeepseekV4HyperConnection": (_PRE, Gate(None, "output", (0, 1))),
    "DeepseekV4HyperHead": (_PRE,),
    "Qwen4ExpTextGatedResidual": _qwen4,
}


def gates_of(module: nn.Module) -> tuple[Gate, ...]:
    """The frozen values of hyper-connection ``module`` (``()``: not one)."""
    gates = STREAM_GATES.get(type(module).__name__, ())
    return gates(module) if callable(gates) else gates
