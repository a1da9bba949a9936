"""The proof of a graph: the frozen replacement model is the model, it is affine in the graph's sources, and every
edge is the effect of removing its source.

`verify` checks, on the frozen model of the graph's prompt (`nncanon.graphs.replacement`):

1. forward: with every leaf at its clean value (transcoder reconstruction plus error at each MLP output), the frozen
   model's head output and MLP inputs are the clean run's;
2. completeness: each target's value (a feature's pre-activation, a logit target) is the sum of its row of the
   adjacency matrix plus its bias term, the target's value on the frozen model with every source node removed
   (the token vectors zero, every node feature's ``activation · W_dec`` row and every error node taken out of the
   MLP outputs: what remains is ``b_dec``, unselected features and position 0 where it is zeroed);
3. edges: for sampled source nodes, the frozen model with that one source removed moves every target by minus its
   column of the adjacency matrix.

Each comparison is relative to the row's scale (``|target| + |bias| + Σ|edges|``). A family whose blocks are not
linear once their norms and patterns are frozen fails 2 and 3 with the numbers (`GraphCheck`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidInput, ValueNotAvailable
from ..sae import Dictionary, resolve
from .attribution import Setup, setup, target_values
from .coders import WRITE_HOOKS, CrossLayerTranscoder, mlp_blocks, writes_of
from .graph import Graph
from .replacement import frozen_run


@dataclass
class GraphCheck:
    """What `verify` measured: the largest errors, each relative to its row's scale.

    Attributes:
        forward: The frozen model's head output and MLP inputs against the clean run's.
        completeness: Targets against their row sums plus bias.
        edges: Removal effects against the sampled columns.
        rtol: The tolerance each is held to.
        sampled: The source nodes removed.
        block: Where the frozen model is first seen not affine: the lowest block with a feature target over
            ``rtol`` in completeness or edges (the targets of the blocks before it are within), ``n_layers`` where
            only logit targets are (the nonlinearity is after the last block's transcoder input), ``None`` where
            none is.
    """

    forward: float
    completeness: float
    edges: float
    rtol: float
    sampled: list[int] = field(default_factory=list)
    block: int | None = None

    @property
    def ok(self) -> bool:
        """All three within ``rtol``."""
        return max(self.forward, self.completeness, self.edges) <= self.rtol

    def __str__(self) -> str:
        return (f"forward {self.forward:.2e}, completeness {self.completeness:.2e}, edges {self.edges:.2e} "
                f"(relative; tolerance {self.rtol:.0e}; {len(self.sampled)} edges sampled)")


def verify(model: Any, graph: Graph, transcoders: Any, *, samples: int = 6, rtol: float = 1e-4,
           seed: int = 0) -> GraphCheck:
    """Check ``graph`` (built by `nncanon.graphs.attribute` on ``model`` with ``transcoders``) on the frozen model."""
    s = graph_setup(model, graph, transcoders)
    selected = graph.selected_features.to(s.active.device)
    features = selected
    logits = torch.arange(len(s.logit_ids), device=s.active.device)
    n_rows = len(features) + len(logits)
    rows = torch.cat([torch.arange(len(features)), graph.n_nodes - len(logits) + torch.arange(len(logits))])
    adjacency = graph.adjacency_matrix[rows].double()  # [n_rows, n_nodes]

    sources = _sources(s, graph)
    generator = torch.Generator().manual_seed(seed)
    picked = sources[torch.randperm(len(sources), generator=generator)[:samples]].tolist()
    with torch.no_grad():
        # one frozen run: row 0 every leaf clean, row 1 every source node removed, row 2 + b source picked[b] removed
        clean = [s.clean.embeddings[None], *[leaf[None] for leaf in s.leaves]]
        leaves = [leaf.expand(2 + len(picked), *leaf.shape[1:]).clone() for leaf in clean]
        leaves[0][1] = 0
        _remove(s, leaves, graph, range(graph.n_features + graph.n_layers * graph.n_pos), 1)
        for b, node in enumerate(picked):
            _remove(s, leaves, graph, [node], 2 + b)
        inputs, head = frozen_run(model, s.ids, s.plan, s.clean, leaves[0], leaves[1:], s.transcoders)

        def targets(row: int) -> torch.Tensor:
            return target_values(s, inputs, head, features, logits, torch.full((n_rows,), row, dtype=torch.long),
                                 ).double()

        # 1. forward
        forward = _relative(head[0], s.clean.head)
        for layer, x in enumerate(inputs):
            forward = max(forward, _relative(x[0], s.clean.inputs[layer]))
        clean_targets = targets(0)
        # 2. completeness
        bias = targets(1)
        scale = clean_targets.abs() + bias.abs() + adjacency.abs().sum(1) + 1e-12
        per_row = (clean_targets - bias - adjacency.sum(1)).abs() / scale  # [n_rows]
        completeness = float(per_row.max()) if n_rows else 0.0
        # 3. edges
        edges = 0.0
        for b, node in enumerate(picked):
            effect = clean_targets - targets(2 + b)
            wrong = (effect - adjacency[:, node]).abs() / scale
            edges = max(edges, float(wrong.max()) if n_rows else 0.0)
            per_row = torch.maximum(per_row, wrong)
    layers = torch.cat([s.active[features][:, 0].cpu(), torch.full((len(logits),), graph.n_layers)])
    failing = layers[(per_row > rtol).cpu()]
    block = int(failing.min()) if len(failing) else None
    return GraphCheck(forward=forward, completeness=completeness, edges=edges, rtol=rtol, sampled=picked,
                      block=block)


def graph_setup(model: Any, graph: Graph, transcoders: Any, remote: Any = None) -> Setup:
    """The `nncanon.graphs.attribution.Setup` of ``graph``'s prompt, logit targets and ``zero_bos`` (its clean run
    with ``remote`` as `nncanon.graphs.attribute` takes it);
    `InvalidInput` where ``graph`` was not built on ``model`` with ``transcoders`` (another model, other tokens'
    vocabulary, other transcoders: its active features differ)."""
    tokens, n_layers = graph.input_tokens, len(model.layers)
    vocabulary = model.config.get_text_config().vocab_size
    if graph.n_layers != n_layers or not len(tokens) or int(tokens.max()) >= vocabulary or int(tokens.min()) < 0:
        raise InvalidInput(f"this graph ({graph.n_layers} layers, token ids up to {int(tokens.max(initial=0))}) was "
                           f"not built on this {model.config.model_type} model ({n_layers} layers, a vocabulary of "
                           f"{vocabulary})")
    s = setup(model, tokens, transcoders, max_n_logits=len(graph.logit_targets), desired_logit_prob=1.0,
              zero_bos=graph.cfg.get("zero_bos"), remote=remote)
    if not torch.equal(s.active.cpu(), graph.active_features.cpu()):
        raise InvalidInput(f"this graph was not built on this {model.config.model_type} model with these transcoders: "
                           f"on its prompt they give {len(s.active)} active features, the graph holds "
                           f"{len(graph.active_features)}, not the same ones")
    s.logit_ids, s.logit_probs = graph.logit_targets.to(s.logit_ids.device), graph.logit_probabilities
    return s


@dataclass
class QKCheck:
    """What `verify_qk` measured, each relative to its scale (for the query and key, the largest component of the
    sum of their terms' absolute values: a vector's rounding is relative to its size, not to each component's).

    Attributes:
        forward: The frozen model's clean query and key against the surface's (``query_states``, ``key_states`` of
            a trace of the graph's prompt).
        completeness: The surface's query and key against the sum of their sources' contributions plus their bias.
        edges: For sampled sources, the query and key with that source removed against the clean ones less its
            contribution.
        score: The clean score ``q·k·scaling`` from the surface's query and key against the sum of the pairs, the
            cross terms with the biases and the biases' product, relative to ``(Σ_a |q_a| + |q_bias|) · (Σ_b |k_b| +
            |k_bias|) · |scaling|`` (Euclidean norms: what bounds every term, so a query nearly orthogonal to its
            key is held to the rounding of its parts).
        rtol: The tolerance each is held to.
    """

    forward: float
    completeness: float
    edges: float
    score: float
    rtol: float

    @property
    def ok(self) -> bool:
        """All four within ``rtol`` (NaN fails)."""
        return max(self.forward, self.completeness, self.edges, self.score) <= self.rtol

    def __str__(self) -> str:
        return (f"forward {self.forward:.2e}, completeness {self.completeness:.2e}, edges {self.edges:.2e}, score "
                f"{self.score:.2e} (relative; tolerance {self.rtol:.0e})")


def verify_qk(model: Any, qk: Any, rtol: float = 1e-5, remote: Any = None) -> QKCheck:
    """Check a `nncanon.graphs.QKAttribution` ``qk`` of ``model``: its query and key are sums of their sources'
    contributions and biases, each sampled source's removal moves them by its contribution, and the pairs, cross
    terms and biases' product sum to the clean score, recomputed from the surface's ``query_states`` and
    ``key_states`` read in a trace of the prompt of its own (run with ``remote`` as `nncanon.graphs.attribute` takes
    it)."""
    attention = model.layers[qk.layer].self_attn
    with torch.no_grad(), model.trace(qk.input_tokens[None].to(model.device), remote=remote or False):
        query, key = attention.query_states.save(), attention.key_states.save()
    q = query[0, qk.query_position, qk.head].double().cpu()
    k = key[0, qk.key_position, qk.key_head].double().cpu()
    forward, completeness, edges = 0.0, 0.0, 0.0
    for clean, frozen, rows, bias, removed in ((q, qk.frozen_query, qk.query, qk.query_bias, qk.removed_query),
                                               (k, qk.frozen_key, qk.key, qk.key_bias, qk.removed_key)):
        rows, bias = rows.double(), bias.double()
        scale = float((clean.abs() + rows.abs().sum(0) + bias.abs()).max()) + 1e-12  # (the vector's)
        forward = max(forward, _relative(frozen, clean))
        completeness = max(completeness, float(((clean - rows.sum(0) - bias).abs() / scale).max()))
        for b, node in enumerate(qk.sampled):
            effect = frozen.double() - removed[b].double()
            edges = max(edges, float(((effect - rows[node]).abs() / scale).max()))
    qs, ks, qb, kb = qk.query.double(), qk.key.double(), qk.query_bias.double(), qk.key_bias.double()
    terms = [qk.pairs.double().flatten(), qs @ kb * qk.scaling, ks @ qb * qk.scaling, (qb @ kb * qk.scaling)[None]]
    score = float(q @ k) * qk.scaling
    total = sum(float(t.sum()) for t in terms)
    norms = [float(rows.norm(dim=1).sum() + bias.norm()) for rows, bias in ((qs, qb), (ks, kb))]
    scale = abs(score) + norms[0] * norms[1] * abs(qk.scaling) + 1e-12  # (the bound of the terms' rounding)
    return QKCheck(forward=forward, completeness=completeness, edges=edges, score=abs(score - total) / scale,
                   rtol=rtol)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / (b.double().abs().max() + 1e-12))


def _sources(s: Setup, graph: Graph) -> torch.Tensor:
    """The source nodes with a nonzero vector (features, errors, tokens)."""
    nodes = list(range(graph.n_features))
    weights = s.errors.abs().sum(-1)
    for layer, vector in s.folded:  # (a sublayer's output folded into the error node)
        weights[layer] += vector.abs().sum(-1)
    errors = weights.flatten().nonzero()[:, 0] + graph.n_features
    tokens = torch.arange(graph.n_pos) + graph.n_features + graph.n_layers * graph.n_pos
    return torch.cat([torch.tensor(nodes, dtype=torch.long), errors.cpu(), tokens])


def _remove(s: Setup, leaves: list[torch.Tensor], graph: Graph, nodes: Any, row: int) -> None:
    """Take the source ``nodes`` out of batch row ``row`` of ``leaves`` (in place)."""
    n_features, n_pos, n_layers = graph.n_features, graph.n_pos, graph.n_layers
    selected = graph.selected_features
    for node in nodes:
        if node < n_features:
            layer, pos, _ = s.active[selected[node]].tolist()
            for r in range(min(s.sources.shape[1], n_layers - layer)):  # its vectors into layer + r
                leaves[1 + layer + r][row, pos] -= s.sources[selected[node], r]
        elif node < n_features + n_layers * n_pos:
            layer, pos = divmod(node - n_features, n_pos)
            leaves[1 + layer][row, pos] -= s.errors[layer, pos]
            for k, (at, vector) in enumerate(s.folded):  # (its sublayers' outputs, each at its own leaf)
                if at == layer:
                    leaves[1 + n_layers + k][row, pos] -= vector[pos]
        else:
            leaves[0][row, node - n_features - n_layers * n_pos] = 0


def random_transcoders(model: Any, n_features: int = 16, seed: int = 0, threshold: float | None = None,
                       reads: Any = None) -> list[Any]:
    """Random per-layer transcoders for ``model`` (one per block, reading its MLP's input, or where the block runs
    its MLP inline the stream its norm reads, or per block the value of `nncanon.graphs.coders.READS` that ``reads``
    names; writing its ``mlp_output``, or a hyper-connected block's MLP module output:
    `nncanon.graphs.coders.writes_of`; ReLU, or JumpReLU with ``threshold``), in the model's dtype: for checks and
    examples; ``None`` at a block without an MLP."""
    hidden = model.config.get_text_config().hidden_size
    dtype = next(model._module.parameters()).dtype
    generator = torch.Generator().manual_seed(seed)
    writes = WRITE_HOOKS[writes_of(model)]
    out: list[Any] = []
    for layer, mlp in enumerate(mlp_blocks(model)):
        if not mlp:  # (a block without an MLP has no transcoder)
            out.append(None)
            continue
        def normal(*shape: int, std: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator) * std).to(dtype)
        extra = {} if threshold is None else {"threshold": torch.full((n_features,), threshold, dtype=dtype)}
        out.append(Dictionary.from_tensors(
            normal(hidden, n_features, std=hidden ** -0.5), normal(n_features, std=0.1) - 0.2,
            normal(n_features, hidden, std=0.05), normal(hidden, std=0.01),
            architecture="transcoder" if threshold is None else "jumprelu_transcoder",
            hook_name=(f"blocks.{layer}.{_default_read(model, layer)}" if reads is None
                       else f"layers.{layer}.{reads[layer]}"), hook_name_out=f"blocks.{layer}.{writes}",
            name=f"random-{layer}", **extra))
    return out


def _default_read(model: Any, layer: int) -> str:
    """``mlp.hook_in`` where block ``layer`` has an MLP module to read, else ``hook_mlp_in`` (what its norm reads);
    where it runs its MLP inline, ``hook_mlp_in`` where the block is a sum (serves ``mlp_output``), else ``mlp.hook_in``
    (its up projection's input: post-LN OPT's, the stream after its attention's norm)."""
    if not hasattr(model.layers[layer].mlp, "_module"):
        return "hook_mlp_in" if model.support().available("mlp_output", layer=layer) else "mlp.hook_in"
    try:
        resolve(model, f"blocks.{layer}.mlp.hook_in")
    except ValueNotAvailable:
        return "hook_mlp_in"
    return "mlp.hook_in"


def random_clt(model: Any, n_features: int = 16, seed: int = 0, threshold: float | None = None,
               feature_input_hook: str = "hook_resid_mid", skip: bool = False) -> CrossLayerTranscoder:
    """A random cross-layer transcoder for ``model`` (one encoder per block reading ``feature_input_hook``, decoders
    into every later block's ``mlp_output``; ReLU, or JumpReLU with ``threshold``; a skip connection with ``skip``),
    in the model's dtype: for checks and examples."""
    hidden = model.config.get_text_config().hidden_size
    n_layers = len(model.layers)
    dtype = next(model._module.parameters()).dtype
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(dtype)
    return CrossLayerTranscoder(
        W_enc=normal(n_layers, hidden, n_features, std=hidden ** -0.5),
        b_enc=normal(n_layers, n_features, std=0.1) - 0.2,
        W_dec=[normal(n_features, n_layers - s, hidden, std=0.05) for s in range(n_layers)],
        b_dec=normal(n_layers, hidden, std=0.01),
        threshold=None if threshold is None else torch.full((n_layers, n_features), threshold, dtype=dtype),
        W_skip=normal(n_layers, hidden, hidden, std=0.02) if skip else None,
        feature_input_hook=feature_input_hook, feature_output_hook=WRITE_HOOKS[writes_of(model)],
        name=f"random-clt-{seed}")
