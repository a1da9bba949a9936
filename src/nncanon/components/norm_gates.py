"""A block's norms whose output is not the stream over a scale times a weight: a gated norm (AXK2's
``AXK2GatedRMSNorm``: ``y = RMSNorm(x)``, then ``y · sigmoid(mlp(y))``). No norm scale is served for it, so an
attribution graph freezes what makes it nonlinear in the stream through nnsight's ``.source`` (as
`nncanon.graphs.mixers` freezes a linear mixer's gates): its inner norm's ``rsqrt`` scale and its gate, written back
at the clean run's values; the norm is then linear in its input.

`NORM_GATES` maps a norm class to those values (`nncanon.components.mixer_gates.Gate`, relative to the norm module);
`gated_norms` lists a block's such children and which sublayer each feeds.

A post-LN block's last norm, run on the block's sum (OpenAI GPT's ``h = ln_2(n + mlp(n))``), is no role of the surface
(no sublayer's post-norm: it norms the stream itself), so its scale is served nowhere; `BLOCK_NORMS` names it per block
class, frozen as its scale (`Gate` part ``"scale"``: its output the live input over the clean run's scale, times its
weight) after everything else the block computes (`block_gates_of`).
"""

from __future__ import annotations

from torch import nn

from .mixer_gates import Gate

#: Per gated norm class: the values frozen, in the order its forward computes them.
NORM_GATES: dict[str, tuple[Gate, ...]] = {
    "AXK2GatedRMSNorm": (Gate("torch_rsqrt_0", "output", module="norm"), Gate("torch_sigmoid_0", "output")),
}


#: Per block class: the norms it runs on its own sum last, frozen as their scale.
BLOCK_NORMS: dict[str, tuple[str, ...]] = {
    "Block": ("ln_2",),  # (OpenAI GPT: n = ln_1(x + attn(x)), h = ln_2(n + mlp(n)); ln_1 is served as the MLP's norm)
}


def block_gates_of(block: nn.Module) -> tuple[Gate, ...]:
    """The frozen values of ``block`` itself: the scales of the norms it runs on its own sum (`BLOCK_NORMS`)."""
    return tuple(Gate(None, "scale", module=name) for name in BLOCK_NORMS.get(type(block).__name__, ())
                 if getattr(block, name, None) is not None)


def gates_of(module: nn.Module) -> tuple[Gate, ...]:
    """The frozen values of norm ``module`` (``()``: not a gated norm)."""
    return NORM_GATES.get(type(module).__name__, ())


def gated_norms(block: nn.Module, calls: tuple[str, ...], mixer: nn.Module | None) -> list[tuple[str, str]]:
    """``(child name, "mixer" | "mlp")`` for each child of ``block`` in `NORM_GATES`: whether the block calls it
    before its token mixer ``mixer`` (the module; ``None``: it has none) or after it, before its MLP. ``calls`` is
    the block forward's ``.source`` operation names, in the order they run (``self_<child>_0`` a child's call)."""
    names = {child: name for name, child in block.named_children()}
    mixer_at = calls.index(f"self_{names[mixer]}_0") if mixer in names and f"self_{names[mixer]}_0" in calls else None
    found = []
    for name, child in block.named_children():
        if type(child).__name__ in NORM_GATES:
            at = calls.index(f"self_{name}_0")
            found.append((name, "mixer" if mixer_at is not None and at < mixer_at else "mlp"))
    return found
