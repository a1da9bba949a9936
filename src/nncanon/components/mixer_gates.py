"""The data-dependent gates of a linear mixer: what an attribution graph freezes so that the mixer is linear in the
stream (`nncanon.graphs.mixers` reads and writes them through nnsight's ``.source``).

A linear mixer multiplies what it carries along the sequence by values it computes from the stream itself: a short
convolution's ``B`` and ``C`` (LFM2), Mamba's ``dt``, ``B``, ``C`` and output gate, a gated DeltaNet's queries, keys,
``beta`` and decay, the RG-LRU's input and recurrent gates and its GELU output branch (RecurrentGemma). With those
written back at the clean run's values (detached), what is left is linear in the carried input, except the SiLU
after the causal convolution and the gated norm on the output: the SiLU is frozen as its own slope
(``silu(u) = u · sigmoid(u)`` with ``sigmoid(u)`` the clean run's: its gate, frozen as a pattern or an output gate
is; the forward value is unchanged), the gated norm's gate and its ``rsqrt`` scale as clean values.

Each `Gate` names one operation of the mixer's forward (nnsight's ``.source`` name) or one child module's call, and
which of its values are frozen. `GATES` maps a mixer class to its gates; `gates_of` gives them for a module (some
depend on its config: Falcon-H1's optional norm), `mixer_reason` why a class is not linearised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

#: The mixers linearised, and what is frozen in each kind (for messages and docs).
KINDS = {
    "short convolution": "B and C (the stream-computed multipliers around the convolution)",
    "Mamba": "dt, B, C and the output gate at the scan's call, and the convolution's SiLU as its slope",
    "Mamba-2": "dt, B and C at the scan's call, the convolution's SiLU as its slope, the gated norm's gate and scale",
    "gated DeltaNet": "queries, keys (before the kernel's L2 norm), beta and the decay at the kernel's call, the "
                      "convolution's SiLU as its slope, the gated output norm's gate and scale",
    "mLSTM": "queries, keys, the input and forget gates at the cell's call (its normaliser and stabiliser then "
             "frozen with them), the per-head norm's scale and the output gate",
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
            arguments ``items``: positions or keywords), or ``"slope"``: a causal depthwise convolution call
            ``(conv1d, x, ..., activation=...)`` whose output ``silu(u)`` is written as ``u · sigmoid(u_clean)``,
            ``u`` the convolution of its live input ``x`` ``[b, channels, n]`` with the module's weights.
        items: Which elements or arguments.
        module: The child module whose forward holds ``op`` (or whose call it is); ``None``: the mixer's own.
    """

    op: str | None
    part: str = "output"
    items: tuple[int | str, ...] = ()
    module: str | None = None

    @property
    def key(self) -> str:
        """The gate's name among a block's frozen values."""
        return f"mixer:{self.module or ''}:{self.op or 'call'}:{self.part}"


#: The SiLU after the causal convolution, frozen as its slope.
CONV_SLOPE = Gate("causal_conv1d_forward_0", "slope")


def _gated_norm(name: str) -> tuple[Gate, ...]:
    """A gated RMS norm child ``name`` called as ``name(x, gate)``: the gate and the norm's ``rsqrt`` scale."""
    return Gate(None, "inputs", (1,), module=name), Gate("torch_rsqrt_0", "output", module=name)


SHORT_CONV = (Gate("BCx_chunk_0", "output", (0, 1)),)
MAMBA = (CONV_SLOPE, Gate("mamba_scan_forward_0", "inputs", (2, 3, 4, 5)))
MAMBA2 = (CONV_SLOPE, Gate("mamba2_scan_forward_0", "inputs", (2, 3, 4)), *_gated_norm("norm"))
DELTA = (CONV_SLOPE, Gate("torch_chunk_gated_delta_rule_0", "inputs", (0, 1, "g", "beta")))
KIMI_DELTA = (CONV_SLOPE, Gate("chunk_kimi_delta_attention_0", "inputs", (0, 1, "g", "beta")),
              *_gated_norm("o_norm"))


RG_LRU = (Gate("self_act_fn_0", "output"), Gate("torch_sigmoid_0", "output", module="rg_lru"),
          Gate("torch_sigmoid_1", "output", module="rg_lru"))


MLSTM = (Gate(None, "inputs", ("query", "key", "igate", "fgate"), module="mlstm_backend"),
         Gate("self__layer_normalize_0.torch_rsqrt_0", "output", module="multihead_norm"),
         Gate(None, "output", module="ogate_act_fn"))


def _falcon_h1(module: nn.Module) -> tuple[Gate, ...]:
    """Falcon-H1's Mamba-2: the gated norm where ``mamba_rms_norm``, else ``scan · silu(gate)`` with the SiLU
    frozen."""
    if getattr(module, "mamba_rms_norm", False):
        return MAMBA2
    return (*MAMBA2[:2], Gate("torch_nn_functional_silu_0", "output"))


#: Per mixer class: its gates (or a function of the module giving them), and its kind (`KINDS`).
GATES: dict[str, tuple[tuple[Gate, ...] | Callable[[nn.Module], tuple[Gate, ...]], str]] = {
    "Lfm2ShortConv": (SHORT_CONV, "short convolution"),
    "Lfm2MoeShortConv": (SHORT_CONV, "short convolution"),
    "Lfm3ShortConv": (SHORT_CONV, "short convolution"),
    "JambaMambaMixer": (MAMBA, "Mamba"),
    "BambaMixer": (MAMBA2, "Mamba-2"),
    "NemotronHMamba2Mixer": (MAMBA2, "Mamba-2"),
    "Zamba2MambaMixer": (MAMBA2, "Mamba-2"),
    "GraniteMoeHybridMambaLayer": (MAMBA2, "Mamba-2"),
    "FalconH1Mixer": (_falcon_h1, "Mamba-2"),
    "Qwen3NextGatedDeltaNet": ((*DELTA, *_gated_norm("norm")), "gated DeltaNet"),
    "Qwen3_5GatedDeltaNet": ((*DELTA, *_gated_norm("norm")), "gated DeltaNet"),
    "Qwen3_5MoeGatedDeltaNet": ((*DELTA, *_gated_norm("norm")), "gated DeltaNet"),
    "Qwen4ExpTextGatedDeltaNet": ((*DELTA, *_gated_norm("norm")), "gated DeltaNet"),
    "LaraMiniGatedDeltaNet": ((*DELTA, *_gated_norm("norm")), "gated DeltaNet"),
    "OlmoHybridGatedDeltaNet": ((*DELTA, *_gated_norm("o_norm")), "gated DeltaNet"),
    "KimiLinearDeltaAttention": (KIMI_DELTA, "gated DeltaNet"),
    "BailingHybridDeltaAttention": (KIMI_DELTA, "gated DeltaNet"),
    "RecurrentGemmaRecurrentBlock": (RG_LRU, "RG-LRU"),
    "xLSTMLayer": (MLSTM, "mLSTM"),
}


def gates_of(module: nn.Module) -> tuple[Gate, ...]:
    """The gates of mixer ``module`` (its class in `GATES`), in the order its forward computes them."""
    gates, _ = GATES[type(module).__name__]
    return gates(module) if callable(gates) else gates


def mixer_reason(name: str) -> str | None:
    """Why mixer class ``name`` is not linearised by freezing its gates, or ``None`` (it is: `GATES`)."""
    if name in GATES:
        return None
    kinds = ", ".join(f"{kind} ({what})" for kind, what in KINDS.items())
    return (f"its linear mixer ({name}) is not one whose data-dependent gates nncanon freezes, so its output is not "
            f"linear in the stream on the frozen model; the mixers linearised are: {kinds}")
