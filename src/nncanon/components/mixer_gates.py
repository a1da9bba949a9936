"""The data-dependent gates of a linear mixer: what an attribution graph freezes so that the mixer is linear in the
stream (`nncanon.graphs.mixers` reads and writes them through nnsight's ``.source``).

A linear mixer multiplies what it carries along the sequence by values it computes from the stream itself: a short
convolution's ``B`` and ``C`` (LFM2), Mamba's ``dt``, ``B``, ``C`` and output gate (Zamba's, one scan per head:
where they are made, before the per-head scans), a gated DeltaNet's queries, keys, ``beta`` and decay, the RG-LRU's
input and recurrent gates and its GELU output branch (RecurrentGemma). With those written back at the clean run's
values (detached), what is left is linear in the carried input, except the SiLU after the causal convolution and the
gated norm on the output: the SiLU is frozen as its own slope (``silu(u) = u · sigmoid(u)`` with ``sigmoid(u)`` the
clean run's: its gate, frozen as a pattern or an output gate is; the forward value is unchanged), the gated norm's
gate and its ``rsqrt`` scale as clean values.

Each `Gate` names one operation of the mixer's forward (nnsight's ``.source`` name) or one child module's call, and
which of its values are frozen. `GATES` maps a mixer class to its spellings, transformers 5.25's first, then the
older forwards' (5.21-5.24 call ``causal_conv1d_fn``, ``mamba_selective_scan`` and ``mamba2_chunk_scan``):
`nncanon.graphs.mixers` uses the first whose calls the loaded forward makes. `spellings_of` gives them for a module
(some depend on its config: Falcon-H1's optional norm), `mixer_reason` why a class is not linearised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

#: The mixers linearised, and what is frozen in each kind (for messages and docs).
KINDS = {
    "short convolution": "B and C (the stream-computed multipliers around the convolution)",
    "Mamba": "dt, B, C and the output gate at the scan's call, and the convolution's SiLU as its slope",
    "Mamba (one scan per head)": "the output gate at the input projection's chunk, the convolution's SiLU as its "
                                 "slope, dt, B and C at the split of the per-head projection",
    "Mamba-2": "dt, B and C at the scan's call, the convolution's SiLU as its slope, the gated norm's gate and scale",
    "gated DeltaNet": "queries, keys (before the kernel's L2 norm), beta and the decay at the kernel's call, the "
                      "convolution's SiLU as its slope, the gated output norm's gate and scale",
    "mLSTM": "queries, keys, the input and forget gates at the cell's call (its normaliser and stabiliser then "
             "frozen with them), the per-head norm's scale and the output gate",
    "lightning attention": "queries and keys (after the projection's SiLU), the SiLU as its slope on the values, "
                           "the output norm's scale and the output gate",
    "WKV (RWKV's time mix)": "the keys at the WKV kernel's call (its exponential weights then constants) and the "
                             "receptance's sigmoid",
    "RG-LRU": "the output branch's GELU, the input and recurrent gates (sigmoids: the decay and its normaliser then "
              "frozen with them)",
}


@dataclass(frozen=True)
class Gate:
    """Values of one call in a linear mixer's forward, frozen at the clean run's.

    Attributes:
        op: The operation's name in the forward's ``.source`` (``None``: the call of child module ``module``);
            ``"call.op"``: operation ``op`` inside the function that call ``call`` runs.
        part: ``"output"`` (elements ``items`` of its output, a tuple; ``()``: the whole output), ``"inputs"`` (its
            arguments ``items``: positions or keywords), ``"slope"``: a causal depthwise convolution call
            ``(conv1d, x, ..., activation=...)`` whose output ``silu(u)`` is written as ``u · sigmoid(u_clean)``,
            ``u`` the convolution of its live input ``x`` ``[b, channels, n]`` with the module's weights, or
            ``"bounds"``: a clamp call (``x.clamp(min=..., max=...)``, in place too) whose bounds are written as
            tensors, ``-inf``/``inf`` where the clean run's value is inside them and the clean clipped value where
            it clipped (linear where it did not bite, constant where it did), or ``"scale"``: the call of norm
            ``module`` (``op`` ``None``), its output written as its live input centred over the clean run's scale,
            times its weight (`nncanon.components.norms.formula`: a norm computed in one fused call, ``F.rms_norm``),
            or ``"ratio"``: the call of activation ``module`` (``op`` ``None``, ``act(0) = 0``), its output written as
            its live input times the clean run's ``act(u) / u`` (its slope through the origin: the forward's value
            unchanged, the gradient through ``u`` only).
        items: Which elements or arguments; for ``"slope"``, ``()`` (the call is ``(conv1d, x, ...)``) or where
            its input ``x``, weight ``[channels, k]`` and bias are among its arguments (``causal_conv1d_fn``).
        module: The child module whose forward holds ``op`` (or whose call it is); ``None``: the mixer's own.
        runs_from: ``(path, attribute)`` where the call runs only on prompts of at least that many positions: the
            mixer's child at ``path`` (``""``: the mixer) compares its first input's positions with its
            ``attribute`` (DeepSeek-V4's compressor forms a window from ``compress_rate`` positions); on a shorter
            prompt there is nothing to freeze. ``None``: the call always runs.
        batch: The dimension of an ``"output"`` or ``"inputs"`` value that holds the batch (Zamba's per-head values
            hold the heads first, the batch second), repeated over the frozen run's batch.
    """

    op: str | None
    part: str = "output"
    items: tuple[int | str, ...] = ()
    module: str | None = None
    runs_from: tuple[str, str] | None = None
    batch: int = 0

    @property
    def key(self) -> str:
        """The gate's name among a block's frozen values."""
        return f"mixer:{self.module or ''}:{self.op or 'call'}:{self.part}"


#: The SiLU after the causal convolution, frozen as its slope (transformers 5.25's call; before 5.25,
#: ``causal_conv1d_fn(x, weight, bias, activation=...)``, the weight and bias positional or keywords).
CONV_SLOPE = Gate("causal_conv1d_forward_0", "slope")
CONV_FN_SLOPE = Gate("causal_conv1d_fn_0", "slope", (0, 1, 2))
CONV_FN_SLOPE_KW = Gate("causal_conv1d_fn_0", "slope", (0, "weight", "bias"))


def _gated_norm(name: str) -> tuple[Gate, ...]:
    """A gated RMS norm child ``name`` called as ``name(x, gate)``: the gate and the norm's ``rsqrt`` scale."""
    return Gate(None, "inputs", (1,), module=name), Gate("torch_rsqrt_0", "output", module=name)


SHORT_CONV = (Gate("BCx_chunk_0", "output", (0, 1)),)
#: Mamba: ``mamba_scan_forward(self, x, dt, B, C, gate, ...)`` (5.25); ``mamba_selective_scan(x, dt, A, B, C, ...,
#: z=gate)`` (5.21-5.24).
MAMBA = (CONV_SLOPE, Gate("mamba_scan_forward_0", "inputs", (2, 3, 4, 5)))
MAMBA_OLD = (CONV_FN_SLOPE, Gate("mamba_selective_scan_0", "inputs", (1, 3, 4, "z")))
#: Zamba's Mamba, one ``mamba_selective_scan`` per head: ``xBC, gate = chunk(in_proj(h))``, ``dt, B, C =
#: split(x_proj(silu(conv(xBC))))`` per head (frozen there: ``dt``'s projection and softplus then constants).
#: (5.21-5.24 call ``causal_conv1d_fn(x, weight, bias, activation=...)``.)
_ZAMBA_GATE, _ZAMBA_SPLIT = Gate("chunk_0", "output", (1,)), Gate("torch_split_0", "output", (0, 1, 2), batch=1)
ZAMBA_MAMBA = (_ZAMBA_GATE, CONV_SLOPE, _ZAMBA_SPLIT)
ZAMBA_MAMBA_OLD = (_ZAMBA_GATE, CONV_FN_SLOPE, _ZAMBA_SPLIT)
#: Mamba-2: ``mamba2_scan_forward(self, x, B, C, dt, ...)`` (5.25); ``mamba2_chunk_scan(x, dt, A, B, C, ...)``
#: (5.21-5.24).
MAMBA2 = (CONV_SLOPE, Gate("mamba2_scan_forward_0", "inputs", (2, 3, 4)), *_gated_norm("norm"))
MAMBA2_OLD = (CONV_FN_SLOPE, Gate("mamba2_chunk_scan_0", "inputs", (1, 3, 4)), *_gated_norm("norm"))
#: Gated DeltaNets: the kernel's call is spelt alike in 5.21-5.25, the convolution's is not.
_DELTA_RULE = Gate("torch_chunk_gated_delta_rule_0", "inputs", (0, 1, "g", "beta"))
_KIMI_RULE = Gate("chunk_kimi_delta_attention_0", "inputs", (0, 1, "g", "beta"))
DELTA = (CONV_SLOPE, _DELTA_RULE)
DELTA_OLD = (CONV_FN_SLOPE, _DELTA_RULE)
KIMI_DELTA = (CONV_SLOPE, _KIMI_RULE, *_gated_norm("o_norm"))
KIMI_DELTA_OLD = (CONV_FN_SLOPE_KW, _KIMI_RULE, *_gated_norm("o_norm"))


RG_LRU = (Gate("self_act_fn_0", "output"), Gate("torch_sigmoid_0", "output", module="rg_lru"),
          Gate("torch_sigmoid_1", "output", module="rg_lru"))


MLSTM = (Gate(None, "inputs", ("query", "key", "igate", "fgate"), module="mlstm_backend"),
         Gate("self__layer_normalize_0.torch_rsqrt_0", "output", module="multihead_norm"),
         Gate(None, "output", module="ogate_act_fn"))


#: MiniMax's lightning attention: ``q, k, v = split(silu(qkv_proj(h)))``, a decayed linear attention of them, its
#: output normed and gated by ``sigmoid(output_gate(h))``.
LIGHTNING = (Gate(None, "ratio", module="act_fn"), Gate("torch_split_0", "output", (0, 1)),
             Gate(None, "scale", module="norm"), Gate("F_sigmoid_0", "output"))


#: RWKV's time mix: ``output(sigmoid(r) · wkv(k, v))``, the WKV kernel a ratio of ``exp(k)``-weighted sums of ``v``.
WKV = (Gate("self_extract_key_value_0.torch_sigmoid_0", "output"), Gate("rwkv_linear_attention_0", "inputs", (2,)))


def _falcon_h1(mamba2: tuple[Gate, ...]) -> Callable[[nn.Module], tuple[Gate, ...]]:
    """Falcon-H1's Mamba-2 spelt as ``mamba2``: the gated norm where ``mamba_rms_norm``, else ``scan · silu(gate)``
    with the SiLU frozen."""
    def gates(module: nn.Module) -> tuple[Gate, ...]:
        if getattr(module, "mamba_rms_norm", False):
            return mamba2
        return (*mamba2[:2], Gate("torch_nn_functional_silu_0", "output"))
    return gates


#: One spelling of a mixer's gates: the gates, or a function of the module giving them.
Spelling = tuple[Gate, ...] | Callable[[nn.Module], tuple[Gate, ...]]

_QWEN_DELTA = ((*DELTA, *_gated_norm("norm")), (*DELTA_OLD, *_gated_norm("norm")))

#: Per mixer class: its spellings (transformers 5.25's first, then 5.21-5.24's where they differ), and its kind
#: (`KINDS`).
GATES: dict[str, tuple[tuple[Spelling, ...], str]] = {
    "Lfm2ShortConv": ((SHORT_CONV,), "short convolution"),
    "Lfm2MoeShortConv": ((SHORT_CONV,), "short convolution"),
    "Lfm3ShortConv": ((SHORT_CONV,), "short convolution"),
    "JambaMambaMixer": ((MAMBA, MAMBA_OLD), "Mamba"),
    "ZambaMambaMixer": ((ZAMBA_MAMBA, ZAMBA_MAMBA_OLD), "Mamba (one scan per head)"),
    "BambaMixer": ((MAMBA2, MAMBA2_OLD), "Mamba-2"),
    "NemotronHMamba2Mixer": ((MAMBA2, MAMBA2_OLD), "Mamba-2"),
    "Zamba2MambaMixer": ((MAMBA2, MAMBA2_OLD), "Mamba-2"),
    "GraniteMoeHybridMambaLayer": ((MAMBA2, MAMBA2_OLD), "Mamba-2"),
    "FalconH1Mixer": ((_falcon_h1(MAMBA2), _falcon_h1(MAMBA2_OLD)), "Mamba-2"),
    "Qwen3NextGatedDeltaNet": (_QWEN_DELTA, "gated DeltaNet"),
    "Qwen3_5GatedDeltaNet": (_QWEN_DELTA, "gated DeltaNet"),
    "Qwen3_5MoeGatedDeltaNet": (_QWEN_DELTA, "gated DeltaNet"),
    "Qwen4ExpTextGatedDeltaNet": (_QWEN_DELTA, "gated DeltaNet"),
    "LaraMiniGatedDeltaNet": (_QWEN_DELTA, "gated DeltaNet"),
    "OlmoHybridGatedDeltaNet": (((*DELTA, *_gated_norm("o_norm")),
                                 (CONV_FN_SLOPE_KW, _DELTA_RULE, *_gated_norm("o_norm"))), "gated DeltaNet"),
    "KimiLinearDeltaAttention": ((KIMI_DELTA, KIMI_DELTA_OLD), "gated DeltaNet"),
    "BailingHybridDeltaAttention": ((KIMI_DELTA, KIMI_DELTA_OLD), "gated DeltaNet"),
    "RecurrentGemmaRecurrentBlock": ((RG_LRU,), "RG-LRU"),
    "xLSTMLayer": ((MLSTM,), "mLSTM"),
    "MiniMaxLightningAttention": ((LIGHTNING,), "lightning attention"),
    "RwkvSelfAttention": ((WKV,), "WKV (RWKV's time mix)"),
}


def spellings_of(module: nn.Module) -> tuple[tuple[Gate, ...], ...]:
    """The gates of mixer ``module`` (its class in `GATES`) per spelling, each in the order its forward computes
    them: `nncanon.graphs.mixers` freezes the first whose calls the loaded forward makes."""
    spellings, _ = GATES[type(module).__name__]
    return tuple(gates(module) if callable(gates) else gates for gates in spellings)


def mixer_reason(name: str) -> str | None:
    """Why mixer class ``name`` is not linearised by freezing its gates, or ``None`` (it is: `GATES`)."""
    if name in GATES:
        return None
    kinds = ", ".join(f"{kind} ({what})" for kind, what in KINDS.items())
    return (f"its linear mixer ({name}) is not one whose data-dependent gates nncanon freezes, so its output is not "
            f"linear in the stream on the frozen model; the mixers linearised are: {kinds}")
