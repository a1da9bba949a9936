"""`attribute`, on the models a graph can be built on: `support`, the structure's reasons and, where the structure
allows one, the linearity proof on the model itself at first use (`nncanon.graphs.verify` on a graph of a short
prompt over random transcoders reading where the graph's transcoders read), remembered per model and read sites.

What is proved depends on where the transcoders read (`nncanon.graphs.coders.READS`): the frozen model computes a
transcoder's input from the stream differently for ``mlp_input`` (the MLP module's input, through the frozen norm),
``mlp_normalized`` (the stream centred over the clean run's scale), ``resid_mid`` and ``layer_input`` (sums of
stream parts). So the proof runs on random transcoders reading the same site, block by block, as the transcoders of
the graph asked for: a graph reading a site no earlier graph of the model read is proved before it is served (one
small graph per model and read sites, cached).

A block with a nonlinearity on the stream's path that is not a frozen value (a norm inside attention that
`nncanon.components.attention_gates` does not name, a norm whose scale is not served, a clamp of the values, a gate on
attention's output) makes the frozen model non-affine in the graph's sources: the proof measures it and the model is
declined with the numbers.

Under sdpa the pattern is frozen through the kernel's query and key (`nncanon.graphs.replacement.PATTERN_INPUTS`),
which holds only where nothing else of the stream reaches the pattern: the proof also runs the frozen model on the
clean leaves and on random ones and requires every block's pattern (the probabilities recomputed from the kernel
call) to be the clean one in both (`pattern_moves`). A bias made from the stream (Inkling's relative-position
logits, projected from the block's input) moves it: declined with the numbers, under eager the probabilities frozen.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ValueNotAvailable
from ..support import GRAPH_PROOF
from .attribution import build, setup
from .coders import check_transcoders, mlp_blocks
from .graph import Graph
from .replacement import NO_CACHE, frozen_body
from .replacement import support as structural
from .verify import random_transcoders, verify

#: The proof's prompt, and the tolerance of its checks (relative to each row's scale).
PROMPT, RTOL = "The cat sat on the", 1e-4
#: How far a block's frozen pattern may move when the stream does (absolute, probabilities).
PATTERN_ATOL = 1e-6

_PROVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def support(model: Any, reads: Sequence[str] | None = None) -> str | None:
    """Why no attribution graph of ``model`` can be built, or ``None`` (the structure allows it and the frozen
    replacement model of a short prompt was proved affine in its sources, every edge its source's removal).

    ``reads``: per block, the value of `nncanon.graphs.coders.READS` the transcoders read (default: the MLP's input,
    `nncanon.graphs.random_transcoders`'s); each distinct ``reads`` is proved once per model."""
    reason = structural(model)
    if reason is not None:  # (support()'s line says it: the MLP module's output is checked on the model, not the table)
        model.__dict__[GRAPH_PROOF] = reason
        return reason
    default = _default_reads(model)
    key = tuple(reads) if reads is not None else default
    proved = _PROVED.setdefault(model._module, {})
    if key not in proved:
        with model.support_held():
            proved[key] = prove(model, key)
        _PROVED[model._module] = proved  # (a model loaded on meta has another module once the proof dispatched it)
    if key == default:
        model.__dict__[GRAPH_PROOF] = proved[key]  # (support()'s line on graphs: the default reads' proof)
    return proved[key]


def _default_reads(model: Any) -> tuple[str, ...]:
    """The reads of `random_transcoders`' default set on ``model`` (per block)."""
    cached = _DEFAULT.get(model._module)
    if cached is None:
        cached = _DEFAULT[model._module] = tuple(check_transcoders(model, random_transcoders(model, 1)).reads)
    return cached


_DEFAULT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prove(model: Any, reads: Sequence[str] | None = None) -> str | None:
    """The linearity proof on ``model`` (a graph over random transcoders of `PROMPT`, reading ``reads`` per block:
    default the MLP's input): ``None`` where it holds, the reason with the numbers where not.

    Each block's read must be a target of the proof's graph (a selected feature there), or the proof would not see
    it: where the first graph (8 features per block, the 8 of most influence selected) leaves a block without one,
    it is built again over 2 features per block with opposite encoder directions ``w`` and ``-w`` and no encoder
    bias (one of them fires at every position whose input is not orthogonal to ``w``), every active feature
    selected."""
    sites = "" if reads is None else f" with transcoders reading {_sites(reads)}"
    n_layers = len(model.layers)
    blocks = [layer for layer, mlp in enumerate(mlp_blocks(model)) if mlp]  # (those with a transcoder)
    try:
        transcoders = random_transcoders(model, n_features=8, reads=reads)
        graph = build(model, PROMPT, transcoders, max_n_logits=2, max_feature_nodes=8, zero_bos=False)
        if _uncovered(graph, blocks):
            transcoders = random_transcoders(model, n_features=2, seed=1, reads=reads)
            for transcoder in filter(None, transcoders):  # (w and -w: one fires wherever the input is not orthogonal)
                transcoder.b_enc.zero_()
                transcoder.W_enc[:, 1] = -transcoder.W_enc[:, 0]
            graph = build(model, PROMPT, transcoders, max_n_logits=2, zero_bos=False)
        moved = pattern_moves(model, graph, transcoders)  # (the specific reason first, where it holds)
    except Exception as error:  # any failure of the frozen model declines it, with what it was
        return f"the frozen replacement model{sites} could not be run on it ({type(error).__name__}: {error})"
    if moved is not None:
        return moved
    unseen = _uncovered(graph, blocks)
    if unseen:
        return (f"the linearity proof{sites} found no feature active at blocks {', '.join(map(str, unseen))} on its "
                "prompt, so it could not check what the frozen model reads there")
    check = verify(model, graph, transcoders, samples=3, rtol=RTOL)
    if check.ok:
        return None
    return (f"the frozen replacement model{sites} is not affine in the graph's sources on this model ({check}; "
            f"{_first(check.block, n_layers)}): a nonlinearity on the stream's path is not a frozen value (a norm "
            "inside attention, a clamp, a gate on a sublayer's output, an attention sink's scale, a rounding with a "
            "straight-through gradient)")


def _first(block: int | None, n_layers: int) -> str:
    """Where the proof first saw the frozen model not affine (`nncanon.graphs.GraphCheck.block`), in words."""
    if block is None:
        return "no target over the tolerance: the forward check failed"
    if block >= n_layers:
        return "every block's transcoder input is within, the logit targets are not (after the last block's)"
    earlier = "" if not block else ", layers[0]'s is" if block == 1 else f", those of layers 0 to {block - 1} are"
    return f"first at layers[{block}]'s transcoder input{earlier}"


def _uncovered(graph: Graph, blocks: list[int]) -> list[int]:
    """The blocks of ``blocks`` (those with a transcoder) with no selected feature in ``graph`` (their transcoder's
    read is no target of it)."""
    selected = graph.active_features[graph.selected_features][:, 0].tolist() if graph.n_features else []
    return sorted(set(blocks) - set(selected))


def _sites(reads: Sequence[str]) -> str:
    """``reads`` in words: ``mlp_input`` (every block), or ``resid_mid`` at blocks 0, 2 and ``mlp_input`` at..."""
    kinds = dict.fromkeys(reads)
    if len(kinds) == 1:
        return f"{reads[0]} (every block)"
    return "; ".join(f"{kind} at blocks {', '.join(str(i) for i, r in enumerate(reads) if r == kind)}"
                     for kind in kinds)


def pattern_moves(model: Any, graph: Graph, transcoders: Any) -> str | None:
    """Where the pattern is frozen through the kernel's query and key (under sdpa): why it is not a function of them
    alone (a block's frozen pattern moved when the stream did: the largest move, with the layer), or ``None``.

    One frozen run of two batch rows: row 0 every leaf clean, row 1 every leaf random (the clean leaf's scale);
    each such block's probabilities, recomputed from the kernel call with its query and key written, must agree
    within `PATTERN_ATOL`. ``None`` at once where no block freezes its pattern so (eager)."""
    s = setup(model, graph.input_tokens, transcoders, max_n_logits=1, desired_logit_prob=1.0,
              zero_bos=graph.cfg.get("zero_bos"))
    if not any("key_states" in frozen for frozen in s.clean.frozen):
        return None
    generator = torch.Generator().manual_seed(0)
    leaves = []
    for leaf in (s.clean.embeddings, *s.leaves):
        noise = torch.randn(leaf.shape, generator=generator).to(leaf) * leaf.float().std().to(leaf.dtype)
        leaves.append(torch.stack([leaf, noise]))
    patterns: list = []
    with torch.no_grad(), model.trace(s.ids.expand(2, -1), **NO_CACHE):
        frozen_body(model, s.plan, s.clean, leaves[0], leaves[1:], s.transcoders, patterns=patterns)
    moves = [(float((p[0].float() - p[1].float()).abs().max()), layer) for layer, p in patterns]
    move, layer = max(moves, default=(0.0, -1))
    if move <= PATTERN_ATOL:
        return None
    return (f"layers[{layer}]'s attention pattern moved by {move:.2e} (tolerance {PATTERN_ATOL:.0e}) when the stream "
            f"did with the kernel's query and key frozen under {model.config._attn_implementation!r}: a bias or mask "
            "made from the stream reaches it (Inkling's relative-position logits), so it cannot be frozen there; load "
            "the model with attn_implementation=\"eager\" (its probabilities frozen)")


def attribute(model: Any, prompt: Any, transcoders: Any, *, max_n_logits: int = 10, desired_logit_prob: float = 0.95,
              max_feature_nodes: int | None = None, batch_size: int = 64, offload: str | None = None,
              update_interval: int = 4, zero_bos: bool | None = None, verbose: bool = False,
              memory_limit: int | None = None, remote: Any = None, offload_dir: str | os.PathLike | None = None
              ) -> Graph:
    """An attribution graph of ``prompt`` (circuit-tracer's ``attribute``), unpruned.

    Args:
        model: A `nncanon.StandardizedTransformer` (eager or sdpa attention: under sdpa no ``[n, n]`` pattern is
            kept, memory linear in the positions; `nncanon.graphs.support` says which can).
        prompt: A string, a list of token ids or a ``[n]``/``[1, n]`` tensor.
        transcoders: One `nncanon.sae.Dictionary` per block (``None``: that block's MLP output is all error), or
            ``{layer: transcoder}``, or a `nncanon.graphs.CrossLayerTranscoder`
            (`nncanon.graphs.formats.load_transcoders` reads circuit-tracer sets).
        max_n_logits, desired_logit_prob: Logit targets: the most probable tokens until their probabilities sum to
            ``desired_logit_prob``, at most ``max_n_logits``.
        max_feature_nodes: Feature nodes at most (those of most influence on the logits, found as circuit-tracer
            finds them); ``None``: every active feature.
        batch_size: Targets per backward pass at most (the frozen forward runs on this many copies of the prompt;
            fewer where they would not fit the memory available: `nncanon.graphs.memory`).
        offload: ``None`` or ``"cpu"``: finished rows kept in host memory; ``"disk"``: the rows and the adjacency
            matrix in memory-mapped temporary files (host memory no longer holds them). The model is not moved.
        offload_dir: With ``offload="disk"``: the folder of those files (default: the temporary folder, ``TMPDIR``
            honoured).
        update_interval: Batches between re-rankings of the features by influence.
        zero_bos: Zero position 0's features and errors (default: where the prompt starts with a special token).
        verbose: Print the memory estimate before the rows run.
        memory_limit: Bytes available to the graph (default: measured: the device's free memory, the host's
            ``MemAvailable``).
        remote: Run the graph's traces remotely (``True``: NDIF; ``"local"``: nnsight's simulation), as
            ``model.trace(..., remote=...)`` does (docs/remote.md): the clean run, then one request per batch of
            rows, each running the frozen forward and its backward on the server. The forward check runs there
            too: the first request also returns batch row 0's transcoder inputs and head output, compared with the
            clean run's before any row is kept.

    Returns:
        A `Graph` (rows of selected features and logits filled; node order in `nncanon.graphs.graph`).

    Raises:
        ValueNotAvailable: the model cannot be linearised (`nncanon.graphs.support`'s reason: its structure, or
            the linearity proof's numbers, proved for the sites these transcoders read).
        InvalidDictionary: a transcoder of another width, one that names another point, NaN weights.
        InvalidInput: an empty prompt, NaN logits or features.
        GraphTooLarge: the memory estimate exceeds what is available (the message gives both), or the disk of
            ``offload_dir`` cannot hold the rows.
        CannotWrite: ``offload_dir`` missing, not a folder or read-only.
    """
    with model.support_held():  # (its line on graphs, which the proof may set, is not read while a graph is built)
        coders = check_transcoders(model, transcoders) if structural(model) is None else None
        reason = support(model, coders.reads if coders is not None else None)
        if reason is not None:
            raise ValueNotAvailable(f"no attribution graph on this {model.config.model_type} model: {reason}")
        return build(model, prompt, coders, max_n_logits=max_n_logits, desired_logit_prob=desired_logit_prob,
                     max_feature_nodes=max_feature_nodes, batch_size=batch_size, offload=offload,
                     update_interval=update_interval, zero_bos=zero_bos, verbose=verbose, memory_limit=memory_limit,
                     remote=remote, offload_dir=offload_dir)
