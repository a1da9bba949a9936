"""QK attributions: one attention score of a graph's prompt split exactly into pairs of the graph's source nodes.

On the frozen replacement model (`nncanon.graphs.replacement`: every norm's scale, every pattern frozen, each MLP's
output a fixed leaf) the stream is affine in the graph's sources (feature nodes, error nodes, token nodes) plus
constant terms, and so are the query and the key the attention kernel receives at a block (``query_states``,
``key_states``: after rotary), once that block's query and key norms (``query_norm_scale``, ``key_norm_scale``, where
the attention norms them: Qwen3, OLMo-2, Gemma-3...) are frozen too. With ``q = Σ_a q_a + q_bias`` and
``k = Σ_b k_b + k_bias``, the score the softmax receives (before the mask, any position bias and soft-cap)

    score = q·k·scaling = Σ_{a,b} (q_a·k_b)·scaling + (Σ_a q_a)·k_bias·scaling + q_bias·(Σ_b k_b)·scaling
            + q_bias·k_bias·scaling.

``q_a`` (source ``a``'s contribution to the query) is computed as an edge is (`nncanon.graphs.attribution`): one
frozen forward of ``2 · head_dim`` copies of the prompt, copy ``c`` backpropagating from query component ``c`` (copy
``head_dim + c`` from key component ``c``), and `nncanon.graphs.attribution.gradient_rows` turning the gradients at the
leaves into the sources' values. The biases come from the same forward: one more copy with every source node removed
(what remains is the transcoders' ``b_dec``, the features that are not nodes, position 0 where it is zeroed, absolute
position embeddings, the biases of the projections). `nncanon.graphs.verify.verify_qk` checks every attribution
before it is returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..components import attention_gates
from ..errors import InvalidArgument, ValueNotAvailable
from ..reading import in_execution_order
from ..served import operation_name
from . import mixers
from .attribution import batch_leaves, gradient_rows
from .graph import Graph
from .replacement import ATTENTION, NO_CACHE, PATTERN_INPUTS, TAP, frozen_body
from .verify import QKCheck, _remove, _sources, graph_setup, verify_qk

#: A score at or below this is masked (the dtype's minimum added, ``-inf``, GPT-1's ``-1e4`` fill): no softmax weight.
MASKED = -1e4
#: The norms on the query's or key's path that the graph leaves live (its pattern frozen, they move no edge), children
#: of the attention module frozen as their scale (`nncanon.graphs.mixers.write_module`): multi-head latent attention's
#: compressed-query norm.
PATH_NORMS = ("q_a_layernorm",)
#: The query's and key's norms frozen at the block attributed (where its attention norms them), each with the value
#: that says the attention norms them (its input).
QK_NORMS = {"query_norm_scale": "query_states_before_norm", "key_norm_scale": "key_states_before_norm"}


@dataclass
class QKAttribution:
    """One attention score split into pairs of a graph's source nodes (`qk_attribution`).

    Rows are the graph's source nodes in its node order (circuit-tracer's layout): its feature nodes
    (``selected_features``), its error nodes layer-major, its token nodes; ``n_sources = n_features + (n_layers + 1) ·
    n_pos``. The features that are not nodes (``max_feature_nodes``) are in the biases, as they are in a graph row's
    bias term.

    Attributes:
        layer, head, query_position, key_position: The score: block ``layer``'s head ``head``, query position
            ``query_position`` attending to key position ``key_position``.
        key_head: The key/value head ``head`` reads (``head // (H // KV)``).
        query, key: ``[n_sources, head_dim]`` each source's contribution to the query (to the key) the kernel
            receives.
        query_bias, key_bias: ``[head_dim]`` what no source node contributes.
        scaling: The attention's factor on ``q·k`` (its ``scaling``).
        score: The clean score ``q·k·scaling`` (before the mask, position bias and soft-cap), from the frozen
            model's query and key with every source present.
        input_tokens: ``[n_pos]`` the prompt.
        n_features, n_layers, n_pos: The graph's node counts.
        frozen_query, frozen_key: ``[head_dim]`` the frozen model's query and key with every source present.
        sampled: The source nodes whose removal was checked; removed_query, removed_key: ``[len(sampled), head_dim]``
            the frozen model's query and key with each removed.
        check: The check's numbers (`nncanon.graphs.verify.verify_qk`).
    """

    layer: int
    head: int
    query_position: int
    key_position: int
    key_head: int
    query: torch.Tensor
    key: torch.Tensor
    query_bias: torch.Tensor
    key_bias: torch.Tensor
    scaling: float
    score: float
    input_tokens: torch.Tensor
    n_features: int
    n_layers: int
    n_pos: int
    frozen_query: torch.Tensor
    frozen_key: torch.Tensor
    sampled: list[int] = field(default_factory=list)
    removed_query: torch.Tensor | None = None
    removed_key: torch.Tensor | None = None
    check: QKCheck | None = None

    @property
    def pairs(self) -> torch.Tensor:
        """``[n_sources, n_sources]``: ``pairs[a, b]`` is ``q_a·k_b·scaling``, query source ``a`` against key source
        ``b``."""
        return self.query @ self.key.T * self.scaling

    @property
    def bias_terms(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``([n_sources] q_a·k_bias·scaling, [n_sources] q_bias·k_b·scaling, q_bias·k_bias·scaling)``: with the
        pairs, they sum to ``score``."""
        return (self.query @ self.key_bias * self.scaling, self.key @ self.query_bias * self.scaling,
                float(self.query_bias @ self.key_bias) * self.scaling)


def qk_attribution(model: Any, graph: Graph, transcoders: Any, layer: int, head: int, query_position: int,
                   key_position: int, *, samples: int = 4, seed: int = 0, remote: Any = None) -> QKAttribution:
    """Split the attention score of block ``layer``'s head ``head``, query ``query_position`` attending to key
    ``key_position``, into pairs of ``graph``'s source nodes (built by `nncanon.graphs.attribute` on ``model`` with
    ``transcoders``), checked by `nncanon.graphs.verify.verify_qk` (``samples`` sources removed in turn) before it is
    returned: `ValueNotAvailable` with the numbers where it does not hold. ``remote``: every trace it runs (the clean
    run, the query and key read, the frozen forward with its backward, the check's) runs remotely, as
    `nncanon.graphs.attribute`'s do (``True``: NDIF; ``"local"``: nnsight's simulation); the same record comes back.

    `InvalidArgument` for a layer, head or position out of range, a key position after the query's (masked);
    `ValueNotAvailable` for a block without softmax attention or whose attention does not serve its query and key;
    `InvalidInput` for a graph not built on this model with these transcoders.
    """
    n_layers = len(model.layers)
    _check_index("layer", layer, n_layers)
    report = model.support()
    for name in PATTERN_INPUTS:
        if not report.available(name, layer):
            block = type(model.layers[layer]._module).__name__
            raise ValueNotAvailable(f"no QK attribution at layers[{layer}] ({block}) of this {model.config.model_type} "
                                    f"model: {name} is not available: {report.reason(name, layer)}")
    n_pos = len(graph.input_tokens)
    _check_index("query_position", query_position, n_pos)
    _check_index("key_position", key_position, n_pos)
    if key_position > query_position:
        raise InvalidArgument(f"key_position={key_position} is after query_position={query_position}: the causal "
                              "mask hides it from that query, so its score reaches no softmax")
    s = graph_setup(model, graph, transcoders, remote)
    norms = [name for name in QK_NORMS if report.available(name, layer)]
    for name, before in QK_NORMS.items():
        if report.available(before, layer) and name not in norms:  # (a norm that cannot be frozen)
            what = "queries" if name.startswith("query") else "keys"
            raise ValueNotAvailable(f"no QK attribution at layers[{layer}] of this {model.config.model_type} model: "
                                    f"its attention norms its {what}, and {name} is not available, so that norm "
                                    f"cannot be frozen: {report.reason(name, layer)}")
    clean: dict[str, torch.Tensor] = {}  # (filled inside the trace: only saved values leave it)
    norms = in_execution_order(model, layer, norms) if norms else []
    paths = [name for name in PATH_NORMS if getattr(model.layers[layer].self_attn._module, name, None) is not None]
    attention = model.layers[layer].self_attn
    kernel = attention._nncanon.kernel
    call = operation_name(attention.source.names, kernel.op)  # (the source made outside a trace)
    with torch.no_grad(), model.trace(s.ids, remote=remote or False, **NO_CACHE):
        for name in paths:  # (the first calls of the attention's forward)
            clean[name] = mixers.read_module(getattr(attention, name), "scale").save()
        for name in norms:
            clean[name] = getattr(attention, name).save()
        query = attention.query_states.save()  # (read after the norms)
        key = attention.key_states.save()
        arguments = getattr(attention.source, call).inputs.save()  # (the kernel call's: its scale)
        if report.available("attention_scores", layer):
            scores = attention.attention_scores[0, :, query_position, key_position].save()
    (heads, head_dim), groups = query.shape[-2:], key.shape[-2]
    scaling = float(kernel.scale(attention._module, arguments[1], head_dim))
    _check_index("head", head, heads)
    if report.available("attention_scores", layer) and not float(scores[head]) > MASKED:
        raise InvalidArgument(f"key_position={key_position} is masked for query_position={query_position} at "
                              f"layers[{layer}]'s head {head} (its score there is {float(scores[head]):.3g}: a sliding "
                              "window, a sparse attention's choice of keys, or the mask the model was given), so its "
                              "score reaches no softmax")
    key_head = head // (heads // groups)
    picked = _upstream(s, graph, layer, query_position)
    picked = picked[torch.randperm(len(picked), generator=torch.Generator().manual_seed(seed))[:samples]].tolist()
    q, k, rows = _run(s, graph, layer, [*[TAP + name for name in paths], *norms],
                      {name: value.detach() for name, value in clean.items()}, picked, head_dim,
                      (query_position, head), (key_position, key_head), remote)
    columns = torch.cat([graph.selected_features.to(rows.device), torch.arange(len(s.active), rows.shape[1],
                                                                               device=rows.device)])
    query, key = rows[:head_dim, columns].T.cpu(), rows[head_dim:, columns].T.cpu()
    at = 2 * head_dim  # (then: every source present, every source removed, each sampled source removed)
    record = QKAttribution(
        layer=layer, head=head, query_position=query_position, key_position=key_position, key_head=key_head,
        query=query, key=key, query_bias=q[at + 1], key_bias=k[at + 1], scaling=scaling,
        score=float(q[at] @ k[at]) * scaling, input_tokens=graph.input_tokens.cpu(),
        n_features=graph.n_features, n_layers=n_layers, n_pos=n_pos, frozen_query=q[at], frozen_key=k[at],
        sampled=picked, removed_query=q[at + 2:], removed_key=k[at + 2:])
    record.check = verify_qk(model, record, remote=remote)
    if not record.check.ok:
        raise ValueNotAvailable(f"no QK attribution at layers[{layer}] of this {model.config.model_type} model: the "
                                f"frozen model's query and key are not affine in the graph's sources ({record.check})")
    return record


def _check_index(name: str, value: Any, size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise InvalidArgument(f"{name}={value!r}: an int in [0, {size})")


def _upstream(s: Any, graph: Graph, layer: int, position: int) -> torch.Tensor:
    """The graph's source nodes with a nonzero vector (`nncanon.graphs.verify`'s) that can move block ``layer``'s
    query at ``position`` or a key before it: those of earlier blocks, at ``position`` or before."""
    nodes = _sources(s, graph)
    n_features, n_pos, n_layers = graph.n_features, graph.n_pos, graph.n_layers
    at = s.active[graph.selected_features.to(s.active.device)].cpu()  # [n_features, 3] (layer, pos, feature)
    node_layer = torch.full_like(nodes, -1)  # (token nodes: before every block)
    node_pos = (nodes - n_features) % n_pos
    is_feature = nodes < n_features
    node_layer[is_feature] = at[nodes[is_feature], 0]
    node_pos[is_feature] = at[nodes[is_feature], 1]
    is_error = ~is_feature & (nodes < n_features + n_layers * n_pos)
    node_layer[is_error] = (nodes[is_error] - n_features) // n_pos
    return nodes[(node_layer < layer) & (node_pos <= position)]


def _steps(model: Any, layer: int, steps: list[str], norms: list[str]) -> list[str]:
    """Block ``layer``'s steps (`nncanon.graphs.replacement.Plan.steps`) up to its attention kernel, its query and
    key ``norms`` frozen (`PATH_NORMS` as `TAP` steps, then served ones, in the order the block computes them),
    then its query and key read live (`TAP`): the block's frozen values before the pattern, the norms before the
    attention's own frozen values (`ATTENTION`: a compressed-KV norm, a value norm, a clamp), those before the
    kernel's inputs; where the attention's frozen values are all computed inside the kernel call (a sink's scale),
    they are left out (they cannot move its inputs)."""
    cut = next((i for i, step in enumerate(steps) if step in ("attention_probabilities", *PATTERN_INPUTS)),
               len(steps))
    before = steps[:cut]
    if ATTENTION in before:
        gates = attention_gates.gates_of(model.layers[layer].self_attn._module)
        at = before.index(ATTENTION)
        inside = all(gate.op is not None and gate.op.startswith("attention_interface") for gate in gates)
        before = before[:at] + norms + ([] if inside else [ATTENTION]) + before[at + 1:]
    else:
        before = before + norms
    return [*before, *[TAP + name for name in PATTERN_INPUTS]]


def _run(s: Any, graph: Graph, layer: int, norms: list[str], clean_norms: dict[str, torch.Tensor],
         picked: list[int], head_dim: int, query_at: tuple[int, int], key_at: tuple[int, int], remote: Any = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One frozen forward up to block ``layer``'s kernel: copies ``:2·head_dim`` backpropagate from the query's
    (then the key's) components at ``query_at`` (``key_at``), ``(position, head)``; then one copy with every source
    present, one with every source node removed, one per source of ``picked`` removed. The leaves are made, and the
    backward runs, inside the trace (one request where ``remote``: `nncanon.graphs.attribution`'s rows run so).
    Returns the query and key at those places ``[B, head_dim]`` (detached) and the gradient rows ``[2·head_dim,
    n_active + (n_layers + 1) · n_pos]``."""
    plan, model = s.plan, s.model
    plan = replace(plan, steps=[*plan.steps[:layer], _steps(model, layer, plan.steps[layer], norms),
                                *[[] for _ in plan.steps[layer + 1:]]])
    frozen = list(s.clean.frozen)
    frozen[layer] = {**frozen[layer], **{name: value for name, value in clean_norms.items() if name in QK_NORMS}}
    clean = replace(s.clean, frozen=frozen)
    at = 2 * head_dim
    batch = at + 2 + len(picked)
    states: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}

    def tap(block: int, name: str) -> None:  # (inside the trace: the query and key read, a path norm frozen)
        attention = model.layers[block].self_attn
        if name in PATTERN_INPUTS:
            states[name] = getattr(attention, name)
        else:
            mixers.write_module(getattr(attention, name), "scale", clean_norms[name])

    with torch.enable_grad(), model.trace(s.ids.expand(batch, -1), remote=remote or False, **NO_CACHE):
        leaves = batch_leaves(s, batch)
        leaves[0][at + 1] = 0
        _remove(s, leaves, graph, range(graph.n_features + graph.n_layers * graph.n_pos), at + 1)
        for b, node in enumerate(picked):
            _remove(s, leaves, graph, [node], at + 2 + b)
        leaves = [leaf.requires_grad_() for leaf in leaves]
        frozen_body(model, plan, clean, leaves[0], leaves[1:], s.transcoders, taps=tap)
        (q_pos, q_head), (k_pos, k_head) = query_at, key_at
        q, k = states["query_states"][:, q_pos, q_head], states["key_states"][:, k_pos, k_head]
        components = torch.arange(head_dim, device=q.device)
        targets = q[components, components].sum() + k[head_dim + components, components].sum()
        grads = torch.autograd.grad(targets, leaves, allow_unused=True, materialize_grads=True)
        out["rows"] = gradient_rows(s, list(grads), at).save()
        out["q"], out["k"] = q.detach().float().cpu().save(), k.detach().float().cpu().save()
    return out["q"], out["k"], out["rows"]
