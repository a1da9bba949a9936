"""What an attribution graph freezes inside an attention block besides its pattern: the values of its forward that
are a nonlinear function of the stream on the way to the kernel or after it.

- An RMS norm on the value path: multi-head latent attention's compressed-KV norm ``kv_a_layernorm`` on the latent
  ``c_kv`` (before the kernel), BitNet's ``attn_sub_norm`` on the heads' output before ``o_proj`` (after it). Its
  ``rsqrt`` scale (``torch_rsqrt_0`` of the norm's forward) is frozen.
- A clamp of the projections (OLMo's and OLMoE's ``clip_qkv``, in place on the query, key and value; DBRX's and MPT's
  on the fused ``Wqkv`` output): a clamp is linear where it does not bite and constant where it does, so it is
  frozen as its bounds (`nncanon.components.mixer_gates.Gate` part ``"bounds"``): an element the clean run left
  inside them gets no bounds, one it clipped gets its clipped value as both.
- A pattern the surface does not serve: DiffLlama's (two kernel calls, one per half of the values, whose outputs are
  combined head pair by head pair): the query and key inputs of both calls are frozen, so each computes the clean
  pattern while the values stay live; its per-head group norm (``F.rms_norm`` in one call) is frozen as its scale
  (part ``"scale"``). Its place is ``"pattern"``: the gates freeze the pattern themselves, at the attention's step.
- An attention sink's scale: GraniteMoE-SWA multiplies the kernel's output by ``sigmoid(logsumexp(scores) - sink)``
  after the frozen probabilities have weighted the values (its eager kernel's ``sigmoid_0``): frozen as a gate.
- Gemma-4's value norm ``v_norm`` (an RMS norm without a weight: its ``pow(mean(x²) + eps, -0.5)`` is frozen).
- A rounding with a straight-through gradient: Kolibri-1.1's indexed blocks round the values to NVFP4 as
  ``v + (round(v) - v).detach()`` (piecewise constant forward, identity gradient): the rounding's residual (the
  ``detach_1`` call) is frozen, so the values are ``v`` plus a constant.
- A mixture of attention experts' routing (JetMoE's ``experts.router``: the query and output projections of the
  experts each position is routed to, weighted by the router's softmax): the router's logits are frozen, so every
  copy of the prompt takes the clean run's experts and weights.

Written back at the clean run's values (detached, through nnsight's ``.source`` and child modules' calls as
`nncanon.graphs.mixers` writes a linear mixer's gates), the block's output is linear in the stream once its pattern
is frozen too. `ATTENTION_GATES` maps an attention class to its gates (or a function of the module giving them: a
config may leave the norm or the clamp out) and where they run relative to the pattern (``"before"``: on the way to
the kernel; ``"after"``: on its output; ``"pattern"``: they freeze the pattern themselves); `gates_of` gives a
module's, `place_of` where they run, `freezes_pattern` whether they freeze its pattern.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .mixer_gates import Gate

#: One attention class's gates, or a function of the module giving them (``()``: none on this module).
Gates = tuple[Gate, ...] | Callable[[nn.Module], tuple[Gate, ...]]


def _norm(name: str) -> Callable[[nn.Module], tuple[Gate, ...]]:
    """The ``rsqrt`` scale of child norm ``name`` (none where the config leaves it out: Mistral-Large-4's shared-KV
    layers)."""
    def gates(module: nn.Module) -> tuple[Gate, ...]:
        return (Gate("torch_rsqrt_0", "output", module=name),) if getattr(module, name, None) is not None else ()
    return gates


def _clip(ops: tuple[str, ...], clipped: Callable[[nn.Module], bool]) -> Callable[[nn.Module], tuple[Gate, ...]]:
    """The clamps ``ops`` frozen as their bounds, where ``clipped(module)`` (the forward runs them)."""
    def gates(module: nn.Module) -> tuple[Gate, ...]:
        return tuple(Gate(op, "bounds") for op in ops) if clipped(module) else ()
    return gates


#: The compressed-KV norm of multi-head latent attention (runs before the kernel: keys and values).
LATENT = (_norm("kv_a_layernorm"), "before")
#: BitNet's sub-norm on the attention's output (runs after the kernel).
SUB_NORM = (_norm("attn_sub_norm"), "after")
#: OLMo's in-place clamps of the query, key and value projections (where ``config.clip_qkv`` is set).
OLMO_CLIP = (_clip(("query_states_clamp__0", "key_states_clamp__0", "value_states_clamp__0"),
                   lambda module: module.config.clip_qkv is not None), "before")

def _deepseek_v4(module: nn.Module) -> tuple[Gate, ...]:
    """DeepSeek-V4's value path: the shared key-value norm's scale, and on a compressed block its compressor's
    softmax over each window's entries (its gate) and its norm's scale (the compressor's indexer only picks the
    entries each query may see: a mask under the frozen pattern). The compressor's calls run where the prompt fills one
    window at least (``Gate.runs_from``)."""
    gates = (Gate("torch_rsqrt_0", "output", module="kv_norm"),)
    compressor = getattr(module, "compressor", None)
    if compressor is None:
        return gates
    softmax = "new_gate_softmax_0" if hasattr(compressor, "indexer") else "chunk_gate_softmax_0"
    window = ("compressor", "compress_rate")  # (a prompt shorter than one window compresses nothing)
    return (*gates, Gate(softmax, "output", module="compressor", runs_from=window),
            Gate("torch_rsqrt_0", "output", module="compressor.kv_norm", runs_from=window))


def _value_norm(module: nn.Module) -> tuple[Gate, ...]:
    """Gemma-4's value norm ``v_norm``, an RMS norm without a weight: its ``pow(mean(x²) + eps, -0.5)`` (none on a
    KV-shared layer, which reuses an earlier layer's values)."""
    return () if module.is_kv_shared_layer else (Gate("self__norm_0.torch_pow_0", "output", module="v_norm"),)


#: Per attention class: its gates, and whether they run before or after the kernel.
ATTENTION_GATES: dict[str, tuple[Gates, str]] = {
    **{name: LATENT for name in (
        "DeepseekV2Attention", "DeepseekV3Attention", "DeepseekV32Attention", "KimiLinearAttention",
        "BailingHybridAttention", "Glm4MoeLiteAttention", "GlmMoeDsaAttention", "MiniCPM3Attention", "YoutuAttention",
        "AXK1Attention", "AXK2Attention", "HYV4Attention", "HYV4VLAttention", "Dots3NoteTextAttention",
        "LongcatFlashMLA", "Mistral4Attention", "MistralLarge4TextAttention", "Glm5NextTextAttention")},
    "BitNetAttention": SUB_NORM,
    "DoryAttention": SUB_NORM,
    "OlmoAttention": OLMO_CLIP,
    "OlmoeAttention": OLMO_CLIP,
    # (DBRX clamps always: with clip_qkv unset its bounds are None and nothing is clipped)
    "DbrxAttention": (_clip(("qkv_states_clamp_0",), lambda module: True), "before"),
    "MptAttention": (_clip(("mixed_qkv_clamp_0",), lambda module: bool(module.clip_qkv)), "before"),
    "JetMoeAttention": ((Gate(None, "output", module="experts.router.layer"),), "before"),
    "DeepseekV4Attention": (_deepseek_v4, "before"),
    # (the sink's sigmoid runs before the softmax in the kernel: read and written before the probabilities)
    "GraniteMoeSWAAttention": ((Gate("attention_interface_1.sigmoid_0", "output"),), "before"),
    # (a sliding-window block, without an indexer, makes no rounding call)
    "Kolibri1_1Attention": (lambda module: (Gate("detach_1", "output"),) if module.indexer is not None else (),
                            "before"),
    # (Gemma-4's and Gemma-3n's scale-free value norm, ``x · pow(mean(x²) + eps, -0.5)``; a KV-shared layer reuses an
    # earlier one's)
    **{name: (_value_norm, "before")
       for name in ("Gemma4TextAttention", "Gemma4UnifiedTextAttention", "Gemma3nTextAttention")},
    "DiffLlamaAttention": ((Gate("attention_interface_1", "inputs", (1, 2)),
                            Gate("attention_interface_2", "inputs", (1, 2)),
                            Gate(None, "scale", module="groupnorm")), "pattern"),
}


def gates_of(module: nn.Module) -> tuple[Gate, ...]:
    """The frozen values of attention ``module`` (``()``: none), in the order its forward computes them."""
    gates, _ = ATTENTION_GATES.get(type(module).__name__, ((), "before"))
    return gates(module) if callable(gates) else gates


def place_of(module: nn.Module) -> str:
    """Where attention ``module``'s frozen values are computed: ``"before"`` or ``"after"`` the kernel (its
    pattern), or ``"pattern"`` (they freeze the pattern)."""
    return ATTENTION_GATES.get(type(module).__name__, ((), "before"))[1]


def freezes_pattern(name: str | None) -> bool:
    """Whether the gates of attention class ``name`` freeze its pattern themselves (it need not serve one)."""
    return ATTENTION_GATES.get(name or "", ((), ""))[1] == "pattern"
