"""The norms inside an attention block that an attribution graph freezes besides its pattern: an RMS norm on the
value path (multi-head latent attention's compressed-KV norm ``kv_a_layernorm`` on the latent ``c_kv``, BitNet's
``attn_sub_norm`` on the heads' output before ``o_proj``). Its ``rsqrt`` scale is a function of the stream, so with
only the pattern frozen the block's output is not linear in the stream; written back at the clean run's value
(detached, through nnsight's ``.source`` as `nncanon.graphs.mixers` writes a mixer's gates), it is.

`ATTENTION_GATES` maps an attention class to the child norms frozen and where they run relative to the pattern
(``"before"``: on the latent, before the kernel; ``"after"``: on the kernel's output); `gates_of` gives the
`nncanon.components.mixer_gates.Gate` of each (a norm a config leaves out, Mistral-Large-4's shared-KV layers, is
skipped), `place_of` where they run. Every norm named computes its scale as ``torch.rsqrt(...)`` (its forward's
``torch_rsqrt_0`` in transformers 5.25; `nncanon.graphs.mixers.check` declines a forward without it).
"""

from __future__ import annotations

from torch import nn

from .mixer_gates import Gate

#: The compressed-KV norm of multi-head latent attention (runs before the kernel: keys and values).
LATENT = (("kv_a_layernorm",), "before")
#: BitNet's sub-norm on the attention's output (runs after the kernel).
SUB_NORM = (("attn_sub_norm",), "after")

#: Per attention class: the child norms whose scale is frozen, and whether they run before or after the kernel.
ATTENTION_GATES: dict[str, tuple[tuple[str, ...], str]] = {
    **{name: LATENT for name in (
        "DeepseekV2Attention", "DeepseekV3Attention", "DeepseekV32Attention", "KimiLinearAttention",
        "BailingHybridAttention", "Glm4MoeLiteAttention", "GlmMoeDsaAttention", "MiniCPM3Attention", "YoutuAttention",
        "AXK1Attention", "AXK2Attention", "HYV4Attention", "HYV4VLAttention", "Dots3NoteTextAttention",
        "LongcatFlashMLA", "Mistral4Attention", "MistralLarge4TextAttention", "Glm5NextTextAttention")},
    "BitNetAttention": SUB_NORM,
    "DoryAttention": SUB_NORM,
}


def gates_of(module: nn.Module) -> tuple[Gate, ...]:
    """The frozen scales of attention ``module``'s inner norms (``()``: none), in the order its forward runs them."""
    norms, _ = ATTENTION_GATES.get(type(module).__name__, ((), "before"))
    return tuple(Gate("torch_rsqrt_0", "output", module=name) for name in norms
                 if getattr(module, name, None) is not None)


def place_of(module: nn.Module) -> str:
    """Where attention ``module``'s inner norms run: ``"before"`` or ``"after"`` the kernel (its pattern)."""
    return ATTENTION_GATES.get(type(module).__name__, ((), "before"))[1]
