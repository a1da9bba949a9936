"""The data a family is: where its blocks keep each standard value, and what its logits do."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..served import Site, config_factor, describe_factor

if TYPE_CHECKING:
    import torch

#: A function of the model's config and a layer index that returns, for values the layer
#: cannot serve exactly, the reason why (``{"mlp_output": "..."}``).
Declines = Callable[[Any, int], dict]


@dataclass(frozen=True)
class LogitStep:
    """One step the model applies between the last block's output and its logits, besides norm and head.

    ``op`` is ``"softcap"`` (``tanh(x / c) · c``), ``"divide"``, ``"multiply"``, ``"truncate"`` (keep
    the first ``c`` logits: a padded vocabulary), ``"divide_input"`` (divide ``lm_head``'s input, as
    Inkling's μP width multiplier does) or ``"divide_stream"`` (divide the stream entering the final
    norm, as RWKV does after its last block). ``attribute`` is the config attribute holding ``c``, or
    a function of the config that returns it (RWKV's depends on two attributes). A step whose ``c``
    is ``None`` does nothing.
    """

    op: str
    attribute: str | Callable[[Any], Any]

    def factor(self, config: Any) -> Any:
        """``c`` for this config (``None``: the step does nothing)."""
        return config_factor(self.attribute, config)

    def describe(self) -> str:
        """The step for the docs: ``divide `logits_scaling```."""
        return f"{self.op} {describe_factor(self.attribute)}"


def apply_logit_steps(logits: torch.Tensor, family: Family, config: Any) -> torch.Tensor:
    """The family's logit post-processing, in the model's own order of operations."""
    for step in family.logit_steps:
        factor = step.factor(config)
        if factor is None or step.op in ("divide_input", "divide_stream"):
            continue
        if step.op == "truncate":
            logits = logits[..., :factor] if factor < logits.shape[-1] else logits
        elif step.op == "softcap":
            logits = logits / factor
            logits = logits.tanh()
            logits = logits * factor
        elif step.op == "divide":
            logits = logits / factor
        elif step.op == "multiply":
            logits = logits * factor
        else:  # pragma: no cover - a family definition error
            raise ValueError(f"unknown logit step {step.op!r}")
    return logits


@dataclass(frozen=True)
class MLPAnatomy:
    """Where a dense MLP keeps its hidden activations (the neurons), by module paths relative to the block.

    ``down(hidden_norm(activation(pre) · linear))`` is what the MLP computes (``activation(pre)`` where it has no
    linear path); nncanon finds this in the module's structure (`nncanon.components.anatomy.discover`) where a
    family leaves `Family.mlp_anatomy` at ``"auto"``, and the load-time proof checks it (``neurons``).

    Attributes:
        down: The down projection: its input is the neurons (``mlp.hook_post``), ``[b, s, d_mlp]``.
        pre: The projection whose output is the pre-activation (``mlp.hook_pre``: the gate path of a gated MLP).
        linear: The projection whose output is the linear path of a gated MLP (``mlp.hook_pre_linear``);
            ``None`` for an MLP without one.
        fused: Where ``pre`` and ``linear`` are one projection (Phi-3's ``gate_up_proj``): its output holds
            ``pre`` then ``linear`` as two halves of its last axis (``fused_order`` says where they differ).
        fused_order: ``(i, j)``: ``pre`` is half ``i`` and ``linear`` half ``j`` of a fused output.
        activation: The activation: a module path, or the name of one of transformers' activations (``"silu"``)
            for a forward that calls it inline.
        hidden_norm: A norm applied to ``activation(pre) · linear`` before the down projection (BitNet's
            ``ffn_sub_norm``), relative to the block: the neurons are its output.
        flat: The projections run on a flattened ``(b·s, ...)`` tensor (OPT's ``fc1``/``fc2``).
        linear_op: ``(operation, index)``: the linear path is element ``index`` of an operation of the MLP's
            forward (its nnsight ``.source`` name), where no module's output is it (Zamba2 adds a per-block adapter
            to ``gate_up_proj``'s output before it chunks the sum: ``("torch_chunk_0", 1)``).
        combine: ``(mlp, pre, linear) -> neurons``, where the MLP combines its two paths otherwise than
            ``activation(pre) · linear`` (MiniMax-M3's clamped SwiGLU, ``(clamp(up) + 1) · glu(clamp(gate))``); ``mlp``
            is the module holding the down projection. The proof checks it as it checks the product.
    """

    down: str
    pre: str | None = None
    linear: str | None = None
    fused: str | None = None
    fused_order: tuple[int, int] = (0, 1)
    activation: str | None = None
    hidden_norm: str | None = None
    flat: bool = False
    linear_op: tuple[str, int] | None = None
    combine: Callable[[Any, Any, Any], Any] | None = field(default=None, compare=False)


#: Why a family has no absolute position embeddings, by kind (`Embeddings.positions_kind`): the refusal of
#: ``model.position_embeddings``.
POSITION_KINDS = {
    "rotary": "its positions enter through a rotary embedding of the queries and keys inside attention, not the "
              "residual stream",
    "alibi": "its positions enter as an additive bias on the attention scores (ALiBi), not the residual stream",
    "recurrent": "its mixers are recurrent (a state-space or recurrent scan): the order of the tokens is in their "
                 "state, not in a vector added to the stream",
    "nope": "its attention takes no position information (NoPE), and its recurrent mixers see the order of the "
            "tokens through their state, not through a vector added to the stream",
    "relative": "its positions enter as a relative-position bias on the attention scores, not the residual stream",
}


@dataclass(frozen=True)
class Embeddings:
    """How a family's embeddings become the stream entering block 0, by module paths from the ``*ForCausalLM`` root.

    ``layers[0].layer_input == norm(project(token_embeddings) · scale + position_embeddings)`` (on a multi-stream
    model, its first stream), where ``token_embeddings`` is the output of `Family.embed_tokens` (a scale the module
    applies itself, Gemma's ``sqrt(hidden_size)``, is in it) and ``position_embeddings`` that of ``positions``; the
    load-time proof checks it (``embeddings``), and a family whose formula does not hold has its token embeddings
    declined with the check's numbers.

    Attributes:
        positions: The absolute position embedding module (GPT-2's ``transformer.wpe``), ``None`` where the model has
            none.
        positions_kind: Why the model has none: a key of `POSITION_KINDS` (``"rotary"``, ``"alibi"``, ``"recurrent"``,
            ``"nope"``, ``"relative"``), a sentence, or a function of the config that returns either.
        scale: The factor the model's forward multiplies the token embeddings by (Granite's ``embedding_multiplier``):
            a config attribute or a function of the config; ``None``: none outside the embedding module.
        project: A module applied to the token embeddings before the positions are added (OPT's ``project_in``; a
            path the configuration leaves out is passed over).
        norm: A module applied to the sum (BLOOM's ``word_embeddings_layernorm``).
        in_place: The model changes the token embeddings in place after the module returns (CTRL's ``*=``): they are
            served as a copy, their edits written back.
        combine: ``(model, tokens, positions) -> stream`` where the model combines them otherwise (ZAYA's
            ``(tokens + bias) · scale`` by its own parameters); ``model`` is the unwrapped transformers model.
    """

    positions: str | None = None
    positions_kind: str | Callable[[Any], str] = "rotary"
    scale: str | Callable[[Any], Any] | None = None
    project: str | None = None
    norm: str | None = None
    in_place: bool = False
    combine: Callable[[Any, Any, Any], Any] | None = field(default=None, compare=False)

    def no_positions(self, config: Any) -> str:
        """Why a model with ``config`` has no absolute position embeddings (`positions_kind`)."""
        kind = self.positions_kind(config) if callable(self.positions_kind) else self.positions_kind
        return POSITION_KINDS.get(kind, kind)


@dataclass(frozen=True)
class Family:
    """How one architecture family lays out the standard values.

    Paths are native module paths from the ``*ForCausalLM`` root (``layers``, ``embed_tokens``,
    ``norm``) or relative to a block (the sites). The defaults describe a Llama block;
    a family states only where it differs.

    Attributes:
        name: The family's name in the registry and the docs.
        model_types: The ``config.model_type`` values it serves.
        layers: The ``ModuleList`` of blocks.
        embed_tokens: The token embedding.
        norm: The final norm (``None`` where the model has none).
        lm_head: The unembedding.
        before_head: Modules applied between the final norm and ``lm_head`` (OPT's ``project_out``);
            a path the configuration leaves out (or sets to ``None``) is passed over, as is ``norm``.
        attention: The block's softmax attention module (served as ``self_attn``), ``None`` if it has none.
        mixer: The block's token mixer that is not softmax attention (gated DeltaNet, Mamba, short
            convolution...), served as ``linear_attn``; ``None`` if it has none.
        mixer_output: Where the mixer's contribution to the stream is read.
        mixer_head_outputs: The input of the mixer's output projection, viewed per head
            (``None`` where the mixer has no per-head structure there).
        mixer_heads: The config attribute holding the mixer's number of heads.
        mlp: The block's MLP module (served as ``mlp``), or ``None`` where the MLP is not a module.
        attention_output: Where attention's contribution to the stream is read.
        mlp_output: Where the MLP's contribution is read (the whole MoE: routed plus shared).
        router_logits: Where a mixture of experts' router logits are, such that a write changes
            the routing (usually an operation inside the router: ``Site(..., op="router_logits_0")``).
        expert_weights: The routing weights of the chosen experts.
        expert_indices: The chosen experts.
        shared_expert_output: What the shared expert adds (after its gate).
        head_outputs: Each head's output (viewed per head): the input of the output projection,
            or of ``head_norm`` where one sits before it.
        head_shape: ``(heads, head_dim)`` of block ``layer``'s ``head_outputs``, a function of
            ``(config, layer)``, where it is not ``(num_attention_heads, head_dim)``: DiffLlama pairs
            two softmax heads into one differential head ``2·head_dim`` wide, Laguna's blocks have
            their own head counts. ``model.num_heads`` and ``head_dim`` follow it (and raise where
            blocks differ).
        head_norm: A norm over all heads' outputs between them and the output projection (BitNet's
            ``self_attn.attn_sub_norm``), relative to the block; ``None``: the heads are the projection's
            input. A head reaches the stream through this norm, as it ran, and its slice of the projection.
        head_projection: The output projection, relative to the block, where ``head_outputs`` is not its
            input (with ``head_norm``); ``None``: the module ``head_outputs`` is read at.
        probabilities: Source-operation path from the attention module to the operation whose
            first input is the probabilities; ``None``: found through transformers' attention interface.
            A function of the config returns the path where the configuration picks the code path
            (Falcon: ALiBi or RoPE).
        kernel: The call of the attention forward that receives the per-head queries, keys and values
            (`nncanon.components.kernel.Kernel`), where it is not transformers' attention interface (an
            attention written inline), or the reason the kernel's inputs cannot be served (a string); a
            function of the config returns either where the configuration picks the code path (Falcon:
            ALiBi or RoPE). ``None``: the interface where the forward calls it, else declined as inline.
        block_extras: How many elements the block returns after the hidden state (0: a tensor).
        block_tuple: The block returns a tuple even with no extras (Falcon-H1's ``(hidden,)``).
        passes_state: The block takes a recurrent state and returns it updated as its extras: a
            skipped block hands back the state it was given. ``True``: the state is the positional
            arguments after the hidden state (xLSTM); a name: the keyword argument of that name,
            returned as the first extra (RWKV's ``state``).
        component_order: The order the block runs its components in. Values of one trace are read in
            execution order, so a reader of several components follows it (Falcon-H1 runs its Mamba
            mixer before its attention).
        logit_steps: The model's logit post-processing, in order.
        casts_head_input: The model casts the head's input to the head's dtype (Mamba's, xLSTM's and HY-V4's
            ``lm_head(h.to(lm_head.weight.dtype))``: a bf16 model whose stream is kept in fp32).
        residual: The block's residual equation, for the docs and ``support()``.
        declines: Values a configuration cannot serve exactly, with the reason.
        kv_heads: The number of key/value heads, where ``config.num_key_value_heads`` does not say it.
        layouts: For families whose blocks differ (hybrids, dense layers in an MoE model): block kind
            -> the fields that differ from this record for blocks of that kind.
        layout_of: ``(config, layer) -> kind`` for ``layouts``, or a tuple of kinds whose fields are
            applied in order (a hybrid MoE block: its mixer's kind, then its MLP's).
        token_shift_after: Contributions a later sublayer of the block reads at the next position too
            (RWKV's channel mixing shifts tokens): a write to one at position ``p`` moves positions after
            ``p`` by the model's own computation, so the locality check compares earlier positions only.
        head_totals: ``(model, layer, heads, inputs) -> (sum over heads, attention output)`` on the
            tokenized ``inputs`` the heads were read on, where the heads do
            not reach the stream through one output projection (JetMoE's mixture of attention heads):
            the heads check compares these instead of the heads through the projection.
        model_declines: Model-level values (``"resume"``) the family cannot serve exactly, with the reason
            (ZAYA's router state flows from block to block: a forward resumed at a later block lacks it),
            or a function of the config that returns them.
        idle: ``(config, layer) -> reason or None``: blocks the model does not run on the inputs nncanon
            gives it (Mllama's cross-attention blocks on text alone), with the reason. An idle block serves
            ``layer_input`` and ``layer_output`` as the stream passing it (read where it enters the next
            block that runs, else where it leaves the previous one), and no component; ``skip_layers``
            passes over it (it does not run anyway).
        idle_inputs: Forward arguments that would make an idle block run (Mllama's
            ``cross_attention_states``): a trace or ``generate`` given one is refused by name.
        stacked_streams: The blocks take and return ``k`` streams stacked first, ``[k, b, s, d]``
            (Gemma-3n's AltUp): ``layer_input``/``layer_output`` serve them ``[b, s, k·d]``, side by side
            (`nncanon.served.stacked_as_served`), and a skip hands the blocks the stacked layout back.
        merged_streams: The blocks take and return ``k`` streams on their own axis, ``[b, s, k, d]``
            (HY-V4's and DeepSeek-V4's hyper-connections): ``layer_input``/``layer_output`` serve them
            merged, ``[b, s, k·d]``, as a view (`nncanon.served.Site.merge`), ``project_on_vocab`` takes
            that layout, and a skip hands the blocks ``[b, s, k, d]`` back.
        rescale: ``(model, where, x, magnitudes=None) -> (y, magnitudes)``: a stacked-stream model's rescaling
            of its streams by their magnitudes, computed from the streams, where no module does it (Gemma-3n's
            AltUp, inline in the model's forward; ``model`` is the unwrapped transformers model): ``where``
            ``"expand"``, the embeddings ``[b, s, d]`` to the stream entering block 0 ``[b, s, k·d]``;
            ``"collapse"``, the ``[b, s, k·d]`` stream to ``[b, s, d]`` before the final norm (the lens does it
            too). ``magnitudes`` given: those instead of the computed ones (an attribution graph freezes them at the
            clean run's: `nncanon.graphs.streams`); the ones used are returned. ``None``: the final norm takes the
            stream as it is.
        refuse_skip: ``(config, start, end) -> reason or None``: skips of blocks ``start..end`` the model
            cannot run (Gemma-3n: a skipped block that stores keys/values a later block reuses).
        embeddings: How the embeddings become the stream entering block 0 (`Embeddings`): the position
            embeddings, a scale, a projection or norm between them and block 0.
        final_norm: The module whose output is ``model.final_norm_output`` (``None``: ``norm``), one of ``norm`` and
            ``before_head`` (HY-V4's ``model.norm`` after its streams are collapsed), or ``"lm_head"``: the head's
            input, where the final norm module also runs elsewhere (nanochat norms the embeddings with it).
        mlp_anatomy: Where the MLP keeps its neurons (`MLPAnatomy`); ``"auto"``: found in the MLP module's
            structure at load (`nncanon.components.anatomy.discover`); a string other than ``"auto"``: why the
            neurons are not served, a property of the family (a mixture of experts' experts run fused).
        norms: Which norm module (a path relative to the block) plays a role of `nncanon.components.norms.ROLES`
            (``{"mlp_norm": "norm_attn_norm.norm_2"}``), where the block's structure does not tell
            (`nncanon.components.norms.norm_roles` reads the rest from it).
        frozen_sublayers: Paths (relative to the block) of sublayers that no transcoder maps, beside the MLP a
            transcoder replaces (LongCat-Flash's dense MLPs ``mlps.0``, ``mlps.1`` beside its shortcut MoE): an
            attribution graph writes each one's output as a leaf at the clean run's value where the block adds it
            (a block gate of `nncanon.components.norm_gates.BLOCK_GATES` reads and writes it) and folds it into the
            block's error node (`nncanon.graphs.replacement.Plan.sublayers`).
    """

    name: str
    model_types: tuple[str, ...]
    layers: str = "model.layers"
    embed_tokens: str = "model.embed_tokens"
    norm: str | None = "model.norm"
    lm_head: str = "lm_head"
    before_head: tuple[str, ...] = ()
    attention: str | None = "self_attn"
    mixer: str | None = None
    mixer_output: Site | None = None
    mixer_head_outputs: Site | None = None
    mixer_heads: str | None = None
    mlp: str | None = "mlp"
    attention_output: Site = Site("self_attn", index=0)
    mlp_output: Site | None = Site("mlp")
    router_logits: Site | None = None
    expert_weights: Site | None = None
    expert_indices: Site | None = None
    shared_expert_output: Site | None = None
    head_outputs: Site = Site("self_attn.o_proj", key="input")
    head_shape: Callable[[Any, int], tuple[int, int]] | None = None
    head_norm: str | None = None
    head_projection: str | None = None
    probabilities: tuple[str, ...] | Callable[[Any], tuple[str, ...] | None] | None = None
    kernel: Any = field(default=None, compare=False)
    block_extras: int = 0
    block_tuple: bool = False
    passes_state: bool | str = False
    component_order: tuple[str, ...] = ("self_attn", "linear_attn", "mlp")
    logit_steps: tuple[LogitStep, ...] = ()
    casts_head_input: bool = False
    residual: str = "h = x + attn(norm1(x)); y = h + mlp(norm2(h))"
    declines: Declines | None = field(default=None, compare=False)
    kv_heads: Callable[[Any], int] | None = field(default=None, compare=False)
    layouts: dict = field(default_factory=dict, compare=False)
    layout_of: Callable[[Any, int], str] | None = field(default=None, compare=False)
    token_shift_after: tuple[str, ...] = ()
    head_totals: Callable[[Any, int, Any, dict], tuple[Any, Any]] | None = field(default=None, compare=False)
    model_declines: dict[str, str] | Callable[[Any], dict[str, str]] = field(default_factory=dict, compare=False)
    idle: Callable[[Any, int], str | None] | None = field(default=None, compare=False)
    idle_inputs: tuple[str, ...] = ()
    stacked_streams: bool = False
    merged_streams: bool = False
    rescale: Callable[..., tuple[Any, list]] | None = field(default=None, compare=False)
    refuse_skip: Callable[[Any, int, int], str | None] | None = field(default=None, compare=False)
    mlp_anatomy: MLPAnatomy | str = "auto"
    norms: dict[str, str] = field(default_factory=dict, compare=False)
    embeddings: Embeddings = Embeddings()
    final_norm: str | None = None
    frozen_sublayers: tuple[str, ...] = ()

    def for_layer(self, config: Any, layer: int) -> tuple[Family, str | None]:
        """The layout of block ``layer`` (this record with its kind's fields), and the kind's name."""
        if self.layout_of is None:
            return self, None
        kinds = self.layout_of(config, layer)
        kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
        made = self.__dict__.get("_layout_records")
        if made is None:  # a record is data that does not change: each kind's record is made once
            made = {}
            object.__setattr__(self, "_layout_records", made)
        record = made.get(kinds)
        if record is None:
            fields: dict = {}
            for kind in kinds:
                fields.update(self.layouts[kind])
            record = made[kinds] = replace(self, layouts={}, layout_of=None, **fields)
        return record, " ".join(kinds)

    def __getstate__(self) -> dict:
        """The record's fields, without the layout records `for_layer` keeps (a remote request carries less)."""
        state = dict(self.__dict__)
        state.pop("_layout_records", None)
        return state

    def step_factor(self, op: str, config: Any) -> Any:
        """The factor of this family's logit step ``op`` for ``config`` (``None`` where it has none)."""
        return next((step.factor(config) for step in self.logit_steps if step.op == op), None)

    def all_layouts(self) -> list[Family]:
        """This record and every block layout it declares."""
        return [self] + [replace(self, layouts={}, layout_of=None, **fields) for fields in self.layouts.values()]

    def idle_reason(self, config: Any, layer: int) -> str | None:
        """Why block ``layer`` does not run on the inputs nncanon gives the model, or ``None`` when it runs."""
        return self.idle(config, layer) if self.idle is not None else None

    def declined(self, config: Any, layer: int) -> dict:
        """The values layer ``layer`` of a model with ``config`` cannot serve, with the reasons."""
        return dict(self.declines(config, layer)) if self.declines is not None else {}


def stranded_readers(producers: dict[int, list[int]], start: int, end: int) -> tuple[int, list[int]] | None:
    """For a `Family.refuse_skip`: the first producer block skipped by ``start..end`` (``producers``: each block
    that hands state to later blocks in the same forward, with the blocks that read it), and its readers after
    ``end``, which would run without that state; ``None`` where the skip strands no reader."""
    for producer, readers in producers.items():
        later = [j for j in readers if j > end]
        if start <= producer <= end and later:
            return producer, later
    return None

