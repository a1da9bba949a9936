"""A block's norms whose output is not the stream over a scale times a weight: a gated norm (AXK2's
``AXK2GatedRMSNorm``: ``y = RMSNorm(x)``, then ``y · sigmoid(mlp(y))``). No norm scale is served for it, so an
attribution graph freezes what makes it nonlinear in the stream through nnsight's ``.source`` (as
`nncanon.graphs.mixers` freezes a linear mixer's gates): its inner norm's ``rsqrt`` scale and its gate, written back
at the clean run's values; the norm is then linear in its input.

`NORM_GATES` maps a norm class to those values (`nncanon.components.mixer_gates.Gate`, relative to the norm module);
`gated_norms` lists a block's such children and which sublayer each feeds.

A block's own nonlinear steps outside its sublayers (`BLOCK_GATES`, per block class, `block_gates_of`): a post-LN
block's last norm, run on the block's sum (OpenAI GPT's ``h = ln_2(n + mlp(n))``), is no role of the surface (it
norms the stream itself), so its scale is served nowhere: frozen as its scale (`Gate` part ``"scale"``: its output
the live input over the clean run's scale, times its weight) after everything else the block computes. Gemma-4's
per-layer-input branch after the MLP, ``norm(proj(gelu(gate(h)) · p))``, multiplies the stream's GELU by the
block's per-layer input ``p`` (made from the token's own per-layer embedding and a normed projection of its
embedding): ``p`` is frozen at the block's entry (its argument; the token's path through it is in every target's
bias term, as absolute position embeddings are), the GELU as its slope through the origin (part ``"ratio"``) and the
branch's norm as its scale, at the block's end. Gemma-3n's block (`nncanon.families.gemma3n`) freezes the same
branch, and AltUp's routed coefficients: the router's output in ``altup.predict`` (at its entry) and in
``altup.correct`` (last), one module called twice, each call read through its caller's operation; and LAuReL's
post-norm scale, before the attention's pattern (``"attention"``). RWKV's first block norms the stream entering it
(``pre_ln``) before anything else: that norm's scale, at the block's entry. A Zamba hybrid block's norms read no
stream alone (its shared transformer's ``cat[x, embeddings]`` and attention output, its Mamba block's ``x +
linear(T)``): their scales at its entry, before its transcoder's input (``"mlp"``) and before its linear mixer
(``"mixer"``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .mixer_gates import Gate

#: Per gated norm class: the values frozen, in the order its forward computes them.
NORM_GATES: dict[str, tuple[Gate, ...]] = {
    "AXK2GatedRMSNorm": (Gate("torch_rsqrt_0", "output", module="norm"), Gate("torch_sigmoid_0", "output")),
}


def _gemma4(block: nn.Module) -> dict[str, tuple[Gate, ...]]:
    if not getattr(block, "hidden_size_per_layer_input", None):
        return {}
    return {"first": (Gate(None, "inputs", (1,)),),
            "last": (Gate(None, "ratio", module="act_fn"), Gate(None, "scale", module="post_per_layer_input_norm"))}


def _gemma3n(block: nn.Module) -> dict[str, tuple[Gate, ...]]:
    """A Gemma-3n block's own values: its per-layer input (argument 2) and AltUp's prediction coefficients (the
    router's ``tanh`` output in ``altup.predict``) at its entry; LAuReL's post-norm scale before the attention's
    pattern; AltUp's correction coefficients (the router's output in ``altup.correct``), the per-layer-input branch's
    GELU as its slope and its norm's scale last. (The router runs twice per block, through one module: each call is
    read by its caller's operation, ``self_altup_predict_0`` and ``self_altup_correct_0``.)"""
    router = "self_compute_router_modalities_0"
    return {"first": (Gate(None, "inputs", (2,)), Gate(f"self_altup_predict_0.{router}", "output")),
            "attention": (Gate(None, "scale", module="laurel.post_laurel_norm"),),
            "last": (Gate(f"self_altup_correct_0.{router}", "output"), Gate(None, "ratio", module="act_fn"),
                     Gate(None, "scale", module="post_per_layer_input_norm"))}


def _zamba_hybrid(shared: str) -> dict[str, tuple[Gate, ...]]:
    """A Zamba hybrid block's norms, none on the stream alone: its shared transformer's (its own module, the weights
    tied) on ``cat[x, embeddings]`` at its entry and on the attention's output before the MLP, and its Mamba block's
    on ``x + linear(T)`` before the mixer."""
    return {"first": (Gate(None, "scale", module=f"{shared}.input_layernorm"),),
            "mlp": (Gate(None, "scale", module=f"{shared}.pre_ff_layernorm"),),
            "mixer": (Gate(None, "scale", module="mamba_decoder.input_layernorm"),)}


#: Per block class: its own frozen values, at its entry (``"first"``), before its attention's pattern
#: (``"attention"``), before its transcoder's input (``"mlp"``), before its linear mixer (``"mixer"``) and after all
#: else it computes (``"last"``), or a function of the block giving them.
BLOCK_GATES: dict[str, dict[str, tuple[Gate, ...]] | Callable[[nn.Module], dict[str, tuple[Gate, ...]]]] = {
    "Block": {"last": (Gate(None, "scale", module="ln_2"),)},  # (OpenAI GPT; its ln_1 is served as the MLP's norm)
    "Gemma4TextDecoderLayer": _gemma4,
    "Gemma3nTextDecoderLayer": _gemma3n,
    # (RWKV's block 0 norms the stream entering it, pre_ln, before anything else)
    "ZambaHybridLayer": _zamba_hybrid("shared_transf"),
    "Zamba2HybridLayer": _zamba_hybrid("shared_transformer"),
    "RwkvBlock": lambda block: {"first": (Gate(None, "scale", module="pre_ln"),)} if block.layer_id == 0 else {},
    # (post-LN OPT: each norm on the block's sum, its attention's before the MLP, its MLP's last; pre-LN OPT: served)
    "OPTDecoderLayer": lambda block: {} if block.do_layer_norm_before else {
        "mlp": (Gate(None, "scale", module="self_attn_layer_norm"),),
        "last": (Gate(None, "scale", module="final_layer_norm"),)},
    # (LongCat-Flash: after its shortcut MoE, the block's second half; the dense MLPs' outputs are leaves folded into
    # the block's error node: `nncanon.families.Family.frozen_sublayers`)
    "LongcatFlashDecoderLayer": {"last": (
        Gate(None, "output", module="mlps.0"), Gate(None, "scale", module="input_layernorm.1"),
        Gate("torch_rsqrt_0", "output", module="self_attn.1.kv_a_layernorm"),
        Gate("attention_interface_1", "inputs", (1, 2), module="self_attn.1"),
        Gate(None, "scale", module="post_attention_layernorm.1"), Gate(None, "output", module="mlps.1"))},
}


def block_gates_of(block: nn.Module, place: str = "last") -> tuple[Gate, ...]:
    """The frozen values of ``block`` itself at ``place`` (``"first"``: its entry; ``"mlp"``: before its transcoder's
    input; ``"mixer"``: before its linear mixer; ``"last"``: after all else)."""
    gates = BLOCK_GATES.get(type(block).__name__, {})
    return (gates(block) if callable(gates) else gates).get(place, ())


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
