"""The local replacement model: the model with every norm's scale, every attention pattern and every attention gate
frozen at the clean run's values, every linear mixer's data-dependent gates too (`nncanon.graphs.mixers`), the scale
of every norm inside an attention block (`nncanon.components.attention_gates`: multi-head latent attention's
compressed-KV norm, BitNet's sub-norm; a clamp of the projections as its bounds; a mixture of attention experts'
routing: written through `nncanon.graphs.mixers` at the `ATTENTION` step), a gated norm's scale and gate
(`nncanon.components.norm_gates`, at a `NORM_GATES` step before the sublayer it feeds), the modules a family runs
between the final norm and the unembedding (`nncanon.graphs.head`: a norm's scale, an activation's slope), and each
MLP's output a fixed leaf, read and written through the standard surface (the mixers' gates, the attention's and the
gated norms' inner values through nnsight's ``.source``) only. On a model keeping several streams per position
(`nncanon.graphs.streams`) each hyper-connection's stream-computed weights are frozen at a `STREAMS` step before the
sublayer it feeds, the final collapse's before the head, and the MLP leaf is the MLP module's output (``d`` wide).
So it is on a model whose blocks with an MLP serve no ``mlp_output`` (their update is not a sum of contributions:
residual gains, post-norms; `nncanon.graphs.coders.writes_of`): what the block does with the module's output is part
of the frozen model, the post-norm's scale (``mlp_post_norm_scale``) frozen, and the linearity proof checks the rest.
A block without an MLP (a hybrid's Mamba block) has no transcoder: no `INPUT` and no MLP leaf step, its transcoder
input and MLP leaf zero (`Plan.mlp`); a block the model does not run (`nncanon.support.LayerSupport.runs`: Mllama's
cross-attention blocks on text alone) has no steps at all.

Frozen means written back: each norm's scale (``attention_norm_scale``, ``attention_post_norm_scale``,
``mlp_norm_scale``, ``model.final_norm_scale``), each block's ``attention_probabilities`` and ``attention_gate`` (an
output-gated attention's multiplier: Qwen3-Next, Qwen3.5, AFMoE...) are written with the clean run's values,
detached, so the forward's values are the clean run's while no gradient flows through a norm's denominator, a
softmax or a gate. Under sdpa, whose kernel computes no probabilities, the pattern is frozen through the kernel's
``query_states`` and ``key_states`` instead (`PATTERN_INPUTS`, `frozen_names`): the pattern is a function of them
and constants (mask, ALiBi, sinks), so the kernel computes the clean pattern from them, and it keeps no ``[n, n]``
tensor for the backward.
Each block's ``mlp_output`` is written with a leaf tensor (its clean value; less the transcoder's
skip connection, which is added back live), so nothing flows through an MLP's nonlinearity either. The token nodes
are a leaf written to ``model.token_embeddings`` (the token embedding module's output, with the family's scale where
the module applies it; absolute position embeddings, added after, are constants: part of every target's bias
term), or to ``layers[0].layer_input`` where a norm sits between the embeddings and the stream (BLOOM's
``word_embeddings_layernorm``: its scale is no frozen value) or the token embeddings are not served. What is left
between the token nodes and the targets (each transcoder's input, the head's output) is linear: the graph's edges
are gradients times source vectors, and the frozen model is affine in the sources (`nncanon.graphs.verify` proves
it on every graph it checks).

A transcoder's input is read where it was trained (`nncanon.graphs.coders.READS`): the MLP module's input
(``mlp_input``); the MLP norm's input normalised before its weight (``mlp_normalized``, TransformerLens's
``ln2.hook_normalized``), on the frozen model ``centred(stream) / scale`` with the clean run's scale, so the
gradient flows through the frozen scale and not through the norm's weight; or the stream after the mixer
(``resid_mid``, ``layer_input + attention_output``), the stream a norm reads being read as those parts; or the
stream entering the block (``layer_input``).

`plan_of` says what a model freezes (or why it cannot be linearised); `clean_run` reads the clean values;
`frozen_run` runs the frozen model on given leaves (``[B, n, d]``: one batch row per target of a backward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..components import attention_gates, norm_gates
from ..components.norms import statistics
from ..errors import ValueNotAvailable
from ..reading import MLP_MODULE_OUTPUT, host, in_execution_order, read, write_mlp_module_output
from ..sae import resolve, value_at
from ..sae.names import point_reason
from ..support import graph_reason
from . import head as before_head
from . import mixers, streams
from .coders import READS, WRITES, mlp_blocks, writes_of
from .streams import STREAMS

#: The values written back with the clean run's, in a block (those the block serves).
FROZEN = ("attention_norm_scale", "attention_probabilities", "attention_gate", "attention_post_norm_scale",
          "linear_attention_norm_scale", "linear_attention_post_norm_scale", "mlp_norm_scale")

#: What freezes a block's pattern under a kernel that computes no probabilities (sdpa): the kernel's query and key,
#: the only values of the stream the pattern is a function of there (`nncanon.support.graph_reason`); they take
#: ``attention_probabilities``'s place in `FROZEN`.
PATTERN_INPUTS = ("query_states", "key_states")

#: The graph's traces run without a cache: a model that keeps its recurrent state in place across blocks (RWKV's
#: state tensor, written block by block) would otherwise overwrite values its backward needs.
NO_CACHE = {"use_cache": False}

#: Marks where a block's transcoder input is read among its frozen values.
INPUT = "<transcoder input>"
#: Marks where a block's linear mixer runs: its gates read, or written back (`nncanon.graphs.mixers`).
MIXER = "<linear mixer gates>"
#: Marks where a block's attention runs its inner norms (`nncanon.components.attention_gates`): their scales read, or
#: written back (`nncanon.graphs.mixers`, ``attention=True``); the clean values are kept under this key.
ATTENTION = "<attention inner norms>"
#: Prefixes the name of a block's gated norm (its path in the block) where its scale and gate are read, or written
#: back (`nncanon.components.norm_gates`); the clean values are kept under the step's name.
NORM_GATES = "<norm gates> "
#: Prefixes a step a frozen run hands to its caller at its place among a block's steps (`frozen_body`'s ``taps``:
#: a QK attribution reads the query and key live there and freezes the norms on their path, `nncanon.graphs.qk`).
TAP = "<read> "


@dataclass
class Plan:
    """What the frozen model writes and reads, per block, in the order the block computes them.

    Attributes:
        steps: Per block, the names to write (`FROZEN` values, ``mlp_output``), the stream's parts to read
            (``layer_input``, ``attention_output``, for a transcoder reading ``mlp_normalized`` or ``resid_mid``)
            and `INPUT`, in execution order.
        reads: Per block, the value of `READS` its transcoder reads.
        parts: Per block, the values whose sum is the stream the MLP's norm reads (``()`` where not needed).
        final_norm: Whether ``model.final_norm_scale`` is frozen (the model has a final norm).
        head: The unembedding's module path (its output: the logits before the family's soft-cap).
        tokens: Where the token nodes' leaf is written: ``"token_embeddings"`` or ``"layer_input"`` (block 0's).
        scale: The linear logit steps after the head, as ``(op, factor)`` (soft-caps left out: circuit-tracer's
            logit targets are before the final soft-cap).
        points: Per block, the resolved `nncanon.sae.Point` of ``layers.{layer}.mlp_input`` where its transcoder
            reads ``mlp_input`` (resolved once, not in every trace), else ``None``.
        head_stages: The modules between the final norm and the head frozen (`nncanon.graphs.head.stages`).
        writes: What each block's transcoder writes, the frozen model's MLP leaf: ``mlp_output``, or on a
            hyper-connected model the MLP module's output (`nncanon.graphs.streams.WRITES_MODULE`, ``d`` wide); its
            step in `steps` is ``mlp_output``'s (the block's write of it).
        collapse: The path of the module collapsing a hyper-connected model's streams before the head, whose
            weights are frozen (`nncanon.graphs.streams.collapse`), or ``None``.
        mlp: Per block, whether it has an MLP (a block without one, a hybrid's Mamba block, has no transcoder, no
            `INPUT` and no ``mlp_output`` step: its transcoder input and MLP leaf are zero, its error nodes too).
        stacked: Whether the stream entering block 0 is written from the token nodes' leaf with the stacked streams'
            rescaling frozen (`nncanon.graphs.streams.expand`).
        sublayers: The sublayers no transcoder maps (`nncanon.families.Family.frozen_sublayers`), as ``(layer,
            step, path, gate key)``: the block gate step writing the output of the block's child ``path``, and its
            key there. Each is a leaf of the frozen model after the blocks' MLP leaves (its clean output), folded
            into its block's error node.
    """

    steps: list[list[str]]
    reads: list[str]
    parts: list[tuple[str, ...]]
    final_norm: bool
    head: str
    tokens: str = "token_embeddings"
    scale: list[tuple[str, Any]] = field(default_factory=list)
    points: list[Any] = field(default_factory=list)
    head_stages: list[tuple[str, str, str]] = field(default_factory=list)
    writes: str = WRITES
    collapse: str | None = None
    mlp: list[bool] = field(default_factory=list)
    stacked: bool = False
    sublayers: list[tuple[int, str, str, str]] = field(default_factory=list)


def support(model: Any) -> str | None:
    """Why an attribution graph of ``model`` cannot be built on the frozen replacement model, or ``None`` (it can):
    `nncanon.support.graph_reason` (every block's token mixer linear in the stream once its pattern, gate and
    norms' scales are frozen: softmax attention with writable probabilities under ``attn_implementation="eager"``,
    with the kernel's writable query and key under ``"sdpa"``, or a linear mixer whose gates
    `nncanon.components.mixer_gates` names; each block with an MLP serves ``mlp_output`` or its MLP module's output,
    `_writes`)."""
    reason = graph_reason(model.support(), getattr(model.config, "_attn_implementation", "eager"))
    if reason is not None:
        return reason
    try:
        _writes(model)
    except ValueNotAvailable as error:
        return str(error)
    return None


def plan_of(model: Any, reads: list[str] | None = None) -> Plan:
    """The `Plan` of ``model`` for transcoders reading ``reads`` (per block; default ``mlp_input``);
    `ValueNotAvailable` with `support`'s reason where it cannot be linearised."""
    report = model.support()
    implementation = getattr(model.config, "_attn_implementation", "eager")
    reason = graph_reason(report, implementation)  # (`support`, one report)
    if reason is not None:
        raise ValueNotAvailable(f"no attribution graph on this {model.config.model_type} model: {reason}")
    reads = list(reads) if reads is not None else ["mlp_input"] * len(model.layers)
    eager = (implementation or "eager") == "eager"
    writes, mlps = _writes(model), mlp_blocks(model)
    steps, parts, sublayers = [], [], []
    for layer, kind in enumerate(reads):
        assert kind in READS, kind
        if not report.layers[layer].runs:  # (the model does not run it: the stream passes it, no steps at all)
            steps.append([])
            parts.append(())
            continue
        mlp, stream = _mlp_steps(model, report, layer, kind, writes) if mlps[layer] else ([], ())
        mixer = ["linear_attention_input"] if report.available("linear_attention_input", layer) else []
        if mixer:
            mixers.check(model, layer)
        names = [name for name in frozen_names(eager) if report.available(name, layer)] + [*mixer, *mlp, *stream]
        ordered = [WRITES if name == MLP_MODULE_OUTPUT else name for name in in_execution_order(model, layer, names)]
        if mlps[layer]:  # (a block without an MLP has no transcoder: no input, no leaf)
            ordered.insert(ordered.index(WRITES), INPUT)
        ordered = [MIXER if name == "linear_attention_input" else name for name in ordered]
        _place_inner_norms(model, layer, ordered)
        _place_gated_norms(model, layer, ordered)
        streams.place(model, layer, ordered, "mlp_norm_scale" if "mlp_norm_scale" in ordered else INPUT)
        steps.append(ordered)
        parts.append(stream)
        sublayers += _sublayers(model, layer, ordered)
    family = model._family
    scale = [(step.op, step.factor(model.config)) for step in family.logit_steps
             if step.op in ("divide", "multiply", "truncate") and step.factor(model.config) is not None]
    projected = family.embeddings.project is not None and model._optional(family.embeddings.project) is not None
    tokens = ("token_embeddings" if report.available("token_embeddings") and family.embeddings.norm is None
              and not projected else "layer_input")
    points = [resolve(model, f"layers.{layer}.mlp_input") if kind == "mlp_input" and mlps[layer] else None
              for layer, kind in enumerate(reads)]
    return Plan(steps=steps, reads=reads, parts=parts, final_norm=report.available("final_norm_scale"),
                head=family.lm_head, tokens=tokens, scale=scale, points=points, head_stages=before_head.stages(model),
                writes=writes, collapse=streams.collapse(model), mlp=mlps,
                stacked=streams.stacked(model) and tokens == "token_embeddings", sublayers=sublayers)


def _mlp_steps(model: Any, report: Any, layer: int, kind: str, writes: str) -> tuple[list[str], tuple[str, ...]]:
    """Block ``layer``'s MLP-side names to order (the MLP leaf's marker: ``mlp_output``, or where the block serves
    none the MLP module's output, with the post-norm's scale after it then frozen) and the stream parts its
    transcoder's input ``kind`` is made from (``()`` for ``mlp_input``: read as served)."""
    if kind == "mlp_normalized" and not report.available("mlp_norm_scale", layer):
        raise ValueNotAvailable(f"layers[{layer}]'s transcoder reads mlp_normalized, but the MLP norm's scale is "
                                f"not served, so it cannot be frozen: {report.reason('mlp_norm_scale', layer)}")
    stream: tuple[str, ...] = ()
    if kind == "layer_input":
        stream = ("layer_input",)
    elif kind != "mlp_input":
        point = resolve(model, f"blocks.{layer}.hook_mlp_in")
        stream = point.parts if point.value == "resid_mid" else (point.value,)
    if report.available(WRITES, layer):
        return [WRITES], stream
    after = ["mlp_post_norm_scale"] if writes != WRITES and report.available("mlp_post_norm_scale", layer) else []
    return [*after, MLP_MODULE_OUTPUT], stream


def _writes(model: Any) -> str:
    """What ``model``'s transcoders write (`Plan.writes`, `nncanon.graphs.coders.writes_of`), checked served on every
    block with an MLP: `ValueNotAvailable` where the MLP module's output is not (an MLP run inline, one returning a
    tuple)."""
    writes = writes_of(model)
    if writes == WRITES:
        return WRITES
    why = ("keeps several streams per position" if streams.hyper_connected(model)
           else "serves no mlp_output (its update is not a sum of contributions)")
    for layer, mlp in enumerate(mlp_blocks(model)):
        reason = point_reason(model, layer, streams.WRITES_MODULE) if mlp else None
        if reason is not None:
            raise ValueNotAvailable(f"layers[{layer}] {why}, and a transcoder writes its MLP module's output (d "
                                    f"wide), which is not available: {reason}")
    return streams.WRITES_MODULE


def _place_inner_norms(model: Any, layer: int, ordered: list[str]) -> None:
    """Insert `ATTENTION` in block ``layer``'s steps where its attention has values to freeze: before the pattern's
    first frozen value (the compressed-KV norm), after its last (a sub-norm on the kernel's output), or where the
    pattern would be (gates that freeze it: after the attention's norm)."""
    attention = model.layers[layer].__dict__.get("self_attn")
    if attention is None or not attention_gates.gates_of(attention._module):
        return
    place = attention_gates.place_of(attention._module)
    pattern = [i for i, name in enumerate(ordered) if name in ("attention_probabilities", *PATTERN_INPUTS)]
    if place == "pattern":  # (no pattern value: after the attention's norm, before anything after attention)
        pattern = [next(i for i, name in enumerate(ordered) if name not in ("layer_input", "attention_norm_scale"))]
    if not pattern:
        return
    mixers.check(model, layer, mixers.ATTENTION)
    _ = attention.source.names  # (both forwards' sources made outside a trace: made inside one, nnsight finds
    # the attention's calls already run past when the norm's operation is read first)
    at = pattern[-1] + 1 if place == "after" else pattern[0]
    ordered.insert(at, ATTENTION)


def _place_gated_norms(model: Any, layer: int, ordered: list[str]) -> None:
    """Insert a `NORM_GATES` step in block ``layer``'s steps for each gated norm it calls: first (after the stream
    entering it) for the norm before its token mixer, before the transcoder's input for the one before its MLP; and
    the block's own values (`nncanon.components.norm_gates.BLOCK_GATES`) at its entry, before its transcoder's input,
    before its linear mixer, before its attention's pattern (and its inner norms) and last."""
    block = model.layers[layer]
    if norm_gates.block_gates_of(block._module, "first"):  # (the block's own values: at its entry, after all else)
        mixers.check(model, layer, mixers.BLOCK_ENTRY)
        ordered.insert(int(ordered[:1] == ["layer_input"]), NORM_GATES + mixers.BLOCK_ENTRY)
    pattern = next((name for name in ordered if name in (ATTENTION, "attention_probabilities", *PATTERN_INPUTS)), None)
    for owner, before in ((mixers.BLOCK_MLP, INPUT), ("<block mixer>", MIXER), ("<block attention>", pattern)):
        if norm_gates.block_gates_of(block._module, mixers.BLOCK_PLACES[owner]) and before in ordered:
            mixers.check(model, layer, owner)
            ordered.insert(ordered.index(before), NORM_GATES + owner)
    if norm_gates.block_gates_of(block._module, "last"):
        mixers.check(model, layer, mixers.BLOCK)
        ordered.insert(len(ordered) - int(ordered[-1:] == ["layer_output"]), NORM_GATES + mixers.BLOCK)
    if not any(norm_gates.gates_of(child) for child in block._module.children()):
        return
    mixer = block.__dict__.get("self_attn")
    mixer = block.__dict__.get("linear_attn") if mixer is None else mixer
    found = norm_gates.gated_norms(block._module, tuple(block.source.names), getattr(mixer, "_module", None))
    for name, feeds in found:
        mixers.check(model, layer, name)
        _ = getattr(block, name).source.names  # (made outside a trace, as the attention's: `_place_inner_norms`)
        at = int(ordered[:1] == ["layer_input"]) if feeds == "mixer" else ordered.index(INPUT)
        ordered.insert(at, NORM_GATES + name)


def _sublayers(model: Any, layer: int, ordered: list[str]) -> list[tuple[int, str, str, str]]:
    """`Plan.sublayers` of block ``layer``: the block gates among its steps ``ordered`` that write the output of a
    sublayer of ``Family.frozen_sublayers`` (the whole output of that child module's call); `ValueNotAvailable`
    where one has none (it would stay live)."""
    paths = model._family.frozen_sublayers
    found: list[tuple[int, str, str, str]] = []
    for step in ordered:
        owner = step[len(NORM_GATES):] if step.startswith(NORM_GATES) else None
        if owner in mixers.BLOCK_PLACES:
            gates = norm_gates.block_gates_of(model.layers[layer]._module, mixers.BLOCK_PLACES[owner])
            found += [(layer, step, gate.module, gate.key) for gate in gates
                      if gate.module in paths and gate.op is None and gate.part == "output" and not gate.items]
    missing = [path for path in paths if path not in [entry[2] for entry in found]]
    if missing:
        raise ValueNotAvailable(f"layers[{layer}]'s sublayers {', '.join(missing)} have no transcoder and no block "
                                "gate writing their output (nncanon.components.norm_gates.BLOCK_GATES), so they "
                                "cannot be folded into its error node")
    return found


def frozen_names(eager: bool) -> tuple[str, ...]:
    """The values a block's frozen model writes with the clean run's (those it serves): `FROZEN` under eager
    attention (the pattern frozen as its probabilities, circuit-tracer's convention); under a kernel that computes
    none (sdpa), the kernel's query and key in the probabilities' place (`PATTERN_INPUTS`): the same pattern, and
    the kernel keeps no ``[n, n]`` tensor for the backward."""
    if eager:
        return FROZEN
    at = FROZEN.index("attention_probabilities")
    return FROZEN[:at] + PATTERN_INPUTS + FROZEN[at + 1:]


@dataclass
class Clean:
    """The clean run's values (batch row 0), detached.

    Attributes:
        frozen: Per block, the `frozen_names` values it serves, ``[1, ...]``, and its linear mixer's gates (tuples,
            keyed as `nncanon.graphs.mixers.read` keys them); under `ATTENTION` and each `NORM_GATES` step's name,
            its attention's and that gated norm's frozen values (keyed the same way).
        final_scale: ``model.final_norm_scale`` ``[1, n, 1]`` (``None``: no final norm).
        inputs: Per block, the transcoder's input ``[n, d]`` (the value of ``plan.reads`` as the surface serves it).
        outputs: Per block, ``mlp_output`` ``[n, d]``.
        embeddings: The token nodes' vectors ``[n, d]`` (``model.token_embeddings`` or ``layers[0].layer_input``:
            ``plan.tokens``).
        logits: ``model.logits`` ``[n, vocab]`` (after the family's post-processing).
        head: The head's output with the linear logit steps ``[n, vocab]`` (what `frozen_run` returns).
        head_frozen: The values of ``plan.head_stages`` (`nncanon.graphs.head.read`), detached.
        collapse: The frozen values of ``plan.collapse`` (keyed as `nncanon.graphs.mixers.read` keys them).
        expand: Where ``plan.stacked``, the stacked streams' rescaling magnitudes
            (`nncanon.graphs.streams.expand_magnitudes`).
    """

    frozen: list[dict[str, torch.Tensor]]
    final_scale: torch.Tensor | None
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    embeddings: torch.Tensor
    logits: torch.Tensor
    head: torch.Tensor
    head_frozen: list[torch.Tensor] = field(default_factory=list)
    collapse: dict[str, Any] = field(default_factory=dict)
    expand: list[torch.Tensor] = field(default_factory=list)


def _token_site(model: Any, plan: Plan) -> tuple[Any, str]:
    return (model, "token_embeddings") if plan.tokens == "token_embeddings" else (model.layers[0], "layer_input")


def clean_run(model: Any, ids: torch.Tensor, plan: Plan, remote: Any = None) -> Clean:
    """Read the clean run's frozen values, transcoder inputs, MLP outputs, token vectors and logits (one trace;
    ``remote`` as `nncanon.StandardizedTransformer.trace` takes it)."""
    frozen: list[dict[str, torch.Tensor]] = [{} for _ in plan.steps]
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    saved: dict[str, Any] = {}
    gates: dict[int, dict[str, Any]] = {}
    owned: dict[tuple[int, str], dict[str, Any]] = {}
    head = _envoy(model, plan.head)
    owner, name = _token_site(model, plan)
    with torch.no_grad(), model.trace(ids, remote=remote or False, **NO_CACHE):
        saved["embeddings"] = getattr(owner, name).save()
        for layer, steps in enumerate(plan.steps):
            parts: dict[str, torch.Tensor] = {}
            for step in steps:
                if step == INPUT:
                    inputs.append(_clean_input(model, layer, plan, parts).save())
                elif step == WRITES:
                    outputs.append(_mlp_leaf(model, layer, plan).save())
                elif step == MIXER:
                    gates[layer] = mixers.read(model, layer)
                elif step == ATTENTION or step.startswith((NORM_GATES, STREAMS)):
                    owned[layer, step] = mixers.read(model, layer, _owner(step))
                elif step in plan.parts[layer] and step not in FROZEN:
                    parts[step] = read(model, layer, step)
                else:
                    frozen[layer][step] = read(model, layer, step).save()
                    if step in plan.parts[layer]:
                        parts[step] = frozen[layer][step]
        if plan.collapse is not None:
            saved["collapse"] = mixers.read(model, None, plan.collapse)
        if plan.final_norm:
            saved["final"] = model.final_norm_scale.save()
        saved["before_head"] = before_head.read(model, plan.head_stages)
        saved["head"] = head.output.save()
        saved["logits"] = model.logits.save()
    frozen = [{k: v.detach() for k, v in d.items()} for d in frozen]
    for layer, values in gates.items():
        frozen[layer].update(mixers.detached(values))
    for (layer, step), values in owned.items():
        frozen[layer][step] = mixers.detached(values)
    zero = torch.zeros_like(saved["embeddings"][0])
    return Clean(frozen=frozen, final_scale=saved.get("final"),
                 inputs=_per_block([x[0].detach() for x in inputs], plan, zero),
                 outputs=_per_block([x[0].detach() for x in outputs], plan, zero),
                 embeddings=saved["embeddings"][0].detach(), logits=saved["logits"][0].detach(),
                 head=_linear_steps(saved["head"], plan)[0].detach(),
                 head_frozen=[value.detach() for value in saved["before_head"]],
                 collapse=mixers.detached(saved["collapse"]) if "collapse" in saved else {},
                 expand=streams.expand_magnitudes(model, saved["embeddings"][0].detach()) if plan.stacked else [])


def _per_block(values: list[torch.Tensor], plan: Plan, zero: torch.Tensor) -> list[torch.Tensor]:
    """``values`` (one per block with an MLP) per block, ``zero`` ``[n, d]`` at each block without one."""
    found = iter(values)
    return [next(found) if mlp else zero for mlp in (plan.mlp or [True] * len(plan.steps))]


def _owner(step: str) -> str:
    """The block's module whose frozen values an `ATTENTION`, `NORM_GATES` or `STREAMS` step reads."""
    if step.startswith(STREAMS):
        return streams.owner(step)
    return mixers.ATTENTION if step == ATTENTION else step[len(NORM_GATES):]


def _mlp_leaf(model: Any, layer: int, plan: Plan) -> Any:
    """Where block ``layer``'s MLP leaf is (`Plan.writes`): its served ``mlp_output``, or the MLP module's output (of
    an MLP run inline, its down projection's, read through its point: unflattened where it runs on ``(b·s, d)``)."""
    if plan.writes != WRITES and not hasattr(model.layers[layer].mlp, "_module"):
        return value_at(model, f"layers.{layer}.{MLP_MODULE_OUTPUT}")
    return read(model, layer, WRITES if plan.writes == WRITES else MLP_MODULE_OUTPUT)


def _clean_input(model: Any, layer: int, plan: Plan, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The transcoder input of ``layer`` on the clean run: the surface's value."""
    kind = plan.reads[layer]
    if kind == "mlp_input":
        return value_at(model, plan.points[layer])
    if kind == "mlp_normalized":
        return read(model, layer, "mlp_normalized")
    return _stream(plan, layer, parts)


def _stream(plan: Plan, layer: int, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stream the MLP's norm reads: the sum of its parts, in the model's order."""
    total = parts[plan.parts[layer][0]]
    for name in plan.parts[layer][1:]:
        total = total + parts[name]
    return total


def frozen_run(model: Any, ids: torch.Tensor, plan: Plan, clean: Clean, embeddings: torch.Tensor,
               outputs: list[torch.Tensor], coders: Any = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The frozen model on ``embeddings`` ``[B, n, d]`` (the token nodes' leaf, written where ``plan.tokens`` says)
    and ``outputs`` (per block ``[B, n, d]``, written to ``mlp_output``, plus the live skip connection of the
    transcoders ``coders``, a `nncanon.graphs.coders.Coders`; then, optionally, one ``[B, n, d]`` per
    `Plan.sublayers` entry, written as that sublayer's output, else its clean value).

    Returns each block's transcoder input ``[B, n, d]`` and the head's output ``[B, n, vocab]`` with the family's
    linear logit steps (before any soft-cap), both in the autograd graph of the leaves given.
    """
    saved: dict[str, Any] = {}
    with model.trace(ids.expand(embeddings.shape[0], -1), **NO_CACHE):
        inputs, head = frozen_body(model, plan, clean, embeddings, outputs, coders)
        saved["inputs"], saved["head"] = [x.save() for x in inputs], head.save()
    return saved["inputs"], saved["head"]


def frozen_body(model: Any, plan: Plan, clean: Clean, embeddings: torch.Tensor, outputs: list[torch.Tensor],
                coders: Any = None, patterns: list | None = None, taps: Callable[[int, str], None] | None = None
                ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`frozen_run`'s writes and reads, inside an open trace of ``B`` copies of the prompt (a remote one too: the
    backward then runs in the same request, `nncanon.graphs.attribution`). ``patterns``: where the pattern is frozen
    through the kernel's query and key, each such block's ``(layer, attention_probabilities)`` ``[B, H, n, n]``
    (recomputed from the kernel call once both are written) is appended to it (the proof's check that the pattern
    is a function of them alone: `nncanon.graphs.proof`). ``taps``: called with each `TAP` step's block and
    name (without the prefix) where the block's steps place it, inside the trace."""
    batch = embeddings.shape[0]
    inputs: list[torch.Tensor] = []
    owner, name = _token_site(model, plan)
    setattr(owner, name, embeddings)
    if plan.stacked:
        streams.expand(model, embeddings, clean.expand)
    for layer, steps in enumerate(plan.steps):
        parts: dict[str, torch.Tensor] = {}
        for step in steps:
            if step == INPUT:
                inputs.append(_frozen_input(model, layer, plan, clean, parts))
            elif step == WRITES:
                written = outputs[layer]
                skip = coders.skip(layer, inputs[layer]) if coders is not None else None
                if skip is not None:
                    written = written + skip.to(written.dtype)
                if plan.writes == WRITES:
                    model.layers[layer].mlp.mlp_output = written
                else:  # (the MLP module's output: `nncanon.graphs.streams`, a block that is not a sum)
                    write_mlp_module_output(model, layer, written)
            elif step in plan.parts[layer] and step not in FROZEN:
                parts[step] = read(model, layer, step)
            elif step.startswith(TAP) and taps is not None:
                taps(layer, step[len(TAP):])
            elif step == MIXER:
                mixers.freeze(model, layer, clean.frozen[layer])
            elif step == ATTENTION or step.startswith((NORM_GATES, STREAMS)):
                mixers.freeze(model, layer, _with_leaves(plan, layer, step, clean.frozen[layer][step], outputs),
                              _owner(step))
            else:
                _freeze(host(model, layer, step), step, clean.frozen[layer][step], batch)
                if patterns is not None and step == _last_pattern_input(steps):
                    patterns.append((layer, read(model, layer, "attention_probabilities").save()))
        if plan.mlp and not plan.mlp[layer]:  # (no transcoder: its input zero, as the clean run's)
            inputs.append(torch.zeros_like(embeddings))
    if plan.collapse is not None:
        mixers.freeze(model, None, clean.collapse, plan.collapse)
    if plan.final_norm:
        _freeze(model, "final_norm_scale", clean.final_scale, batch)
    before_head.freeze(model, plan.head_stages, clean.head_frozen)
    return inputs, _linear_steps(_envoy(model, plan.head).output, plan)


def _with_leaves(plan: Plan, layer: int, step: str, values: dict[str, Any], outputs: list[torch.Tensor]
                 ) -> dict[str, Any]:
    """A gate step's clean ``values`` with each sublayer output it writes (`Plan.sublayers`) replaced by its leaf in
    ``outputs`` (after the blocks' MLP leaves, in `Plan.sublayers`' order; where ``outputs`` holds the blocks' only,
    the clean value stays: a constant of the frozen model)."""
    for index, (at, name, _, key) in enumerate(plan.sublayers):
        if (at, name) == (layer, step) and len(outputs) > len(plan.steps) + index:
            values = {**values, key: (outputs[len(plan.steps) + index],)}
    return values


def _last_pattern_input(steps: list[str]) -> str | None:
    """The last of `PATTERN_INPUTS` a block's steps write, where they write both (else ``None``)."""
    written = [step for step in steps if step in PATTERN_INPUTS]
    return written[-1] if len(written) == len(PATTERN_INPUTS) else None


def _frozen_input(model: Any, layer: int, plan: Plan, clean: Clean, parts: dict[str, torch.Tensor]
                  ) -> torch.Tensor:
    """The transcoder input of ``layer`` on the frozen model, linear in the leaves (``mlp_normalized``: the stream
    centred and divided by the clean run's scale, so the gradient flows through the frozen scale)."""
    kind = plan.reads[layer]
    if kind == "mlp_input":
        return value_at(model, plan.points[layer])
    stream = _stream(plan, layer, parts)
    if kind != "mlp_normalized":
        return stream
    anatomy = model.layers[layer].mlp._nncanon_norm("mlp_normalized").site.anatomy
    centred, _ = statistics(anatomy, stream)
    return (centred / clean.frozen[layer]["mlp_norm_scale"]).to(stream.dtype)


def _freeze(owner: Any, name: str, value: torch.Tensor, batch: int) -> None:
    """Write the clean ``value`` (``[1, ...]``, for ``batch`` rows) to ``owner.name`` and stop the gradient at it.

    A write of a value equal to the model's own leaves the model's tensor in place (nothing changed), and a norm's
    served scale stays in the autograd graph of its input; so the gradient arriving at the served tensor is
    dropped there (a hook returning zeros): the backward sees the value as the constant it is written as.
    """
    current = getattr(owner, name)
    if current.requires_grad:
        current.register_hook(torch.zeros_like)
    setattr(owner, name, value.expand(batch, *value.shape[1:]).contiguous())  # (a family may .view() it)


def _linear_steps(logits: torch.Tensor, plan: Plan) -> torch.Tensor:
    for op, factor in plan.scale:
        if op == "truncate":
            logits = logits[..., :factor]
        elif op == "divide":
            logits = logits / factor
        else:
            logits = logits * factor
    return logits


def _envoy(model: Any, path: str) -> Any:
    envoy = model
    for part in path.split("."):
        envoy = getattr(envoy, part)
    return envoy
