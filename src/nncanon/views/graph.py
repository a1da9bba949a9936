"""The attribution graph view: a pruned `nncanon.graphs.Graph` as an interactive page.

Nodes are laid out by layer (rows: the tokens at the bottom, the blocks, the logits on top) and position (columns,
labelled by the prompt's tokens): a feature is a circle, an error node a square sized by its share of the graph's
influence on the logits, a logit a box with its probability. Hover or click a feature for its activation, its
strongest incoming and outgoing edges and (given ``contexts``) its top activating contexts; a slider hides the
weaker edges; pinned nodes export as a JSON subgraph. The graph is pruned as circuit-tracer's frontend receives it
(`nncanon.graphs.prune`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidInput
from ..graphs.graph import Graph
from ..graphs.prune import PruneResult, node_influence, prune
from .page import Page, render, rounded
from .text import context_record, token_strings

#: Node kinds, as the page's ``kind`` column holds them.
FEATURE, ERROR, TOKEN, LOGIT = 0, 1, 2, 3

#: ``contexts``: ``{(layer, feature): [(activation, "left[[token]]right"), ...]}`` (`TopContexts.contexts`' form),
#: ``{layer: TopContexts}``, or a function ``(layer, feature) -> that list``.
Contexts = Mapping[Any, Any] | Callable[[int, int], Sequence[tuple[float, str]]]


def check_graph(graph: Graph, tokenizer: Any = None) -> None:
    """Raise `InvalidInput` where ``graph``'s fields disagree (a field from another graph or model) or hold NaN."""
    n = graph.n_nodes
    shape = tuple(graph.adjacency_matrix.shape)
    if shape != (n, n):
        raise InvalidInput(
            f"the graph's adjacency_matrix is {list(shape)}, but its fields give {n} nodes ({graph.n_features} "
            f"features + ({graph.n_layers} layers + 1) x {graph.n_pos} tokens + {graph.n_logits} logits): a field "
            "comes from another graph or model (a different prompt length, layer count or feature list)")
    if len(graph.activation_values) != len(graph.active_features):
        raise InvalidInput(f"the graph has {len(graph.active_features)} active_features but "
                           f"{len(graph.activation_values)} activation_values")
    if graph.n_features and int(graph.selected_features.max()) >= len(graph.active_features):
        raise InvalidInput("selected_features indexes past active_features: the fields come from different graphs")
    if len(graph.logit_probabilities) != graph.n_logits:
        raise InvalidInput(f"the graph has {graph.n_logits} logit_targets but {len(graph.logit_probabilities)} "
                           "logit_probabilities")
    for name in ("adjacency_matrix", "activation_values", "logit_probabilities"):
        value = getattr(graph, name)
        if value.numel() and not bool(torch.isfinite(value.float()).all()):
            bad = int((~torch.isfinite(value.float())).sum())
            raise InvalidInput(f"the graph's {name} holds {bad} NaN or infinite values: rebuild the graph "
                               "(NaN activations mean the model or its transcoders overflowed on this prompt)")
    if tokenizer is not None and graph.n_pos:
        vocab = len(tokenizer)
        ids = torch.cat([graph.input_tokens.flatten(), graph.logit_targets.flatten()]).tolist()
        outside = [i for i in ids if not 0 <= int(i) < vocab]
        if outside:
            raise InvalidInput(f"token ids {outside[:5]} are outside the tokenizer's {vocab} tokens: the graph "
                               "comes from another model than this tokenizer's")


def _contexts_for(contexts: Contexts | None, layer: int, feature: int) -> list:
    if contexts is None:
        return []
    if callable(contexts):
        found = contexts(layer, feature)
    elif (layer, feature) in contexts:
        found = contexts[(layer, feature)]
    elif layer in contexts and hasattr(contexts[layer], "contexts"):
        table = contexts[layer]
        found = table.contexts(feature) if bool((table.features == feature).any()) else []
    else:
        found = []
    return [context_record(value, text) for value, text in found or []]


def graph_data(graph: Graph, tokenizer: Any = None, node_threshold: float = 0.8, edge_threshold: float = 0.98,
               contexts: Contexts | None = None, pruned: PruneResult | None = None) -> dict:
    """The page's data: the kept nodes as columns (``kind``, ``layer``, ``pos``, ``feature``, ``act``, ``infl``,
    ``share``) and the kept edges (``src``, ``tgt``, ``w``: indices into the node columns), tokens and logits.

    Raises:
        InvalidInput: `check_graph`'s disagreements (another model's graph, NaN).
    """
    check_graph(graph, tokenizer)
    tokens = token_strings(graph.input_tokens.tolist(), tokenizer)
    logits = token_strings(graph.logit_targets.tolist(), tokenizer)
    data: dict[str, Any] = {"tokens": tokens, "n_layers": graph.n_layers, "prompt": graph.input_string,
                            "node_threshold": node_threshold, "edge_threshold": edge_threshold,
                            "model": graph.cfg.get("model_name") or graph.cfg.get("model_type"), "scan": graph.scan}
    columns: dict[str, list] = {key: [] for key in ("kind", "layer", "pos", "feature", "act", "infl", "share")}
    data.update(nodes=columns, src=[], tgt=[], w=[], contexts={}, logits=logits)
    if graph.n_pos == 0:
        return data
    adjacency = graph.adjacency_matrix.float().cpu()
    node_mask, edge_mask, _ = pruned if pruned is not None else prune(graph, node_threshold, edge_threshold)
    if tuple(node_mask.shape) != (graph.n_nodes,) or tuple(edge_mask.shape) != (graph.n_nodes, graph.n_nodes):
        raise InvalidInput(f"pruned= holds masks of {list(node_mask.shape)} and {list(edge_mask.shape)} nodes, but the "
                           f"graph has {graph.n_nodes}: a prune of another graph")
    influence = node_influence(graph).float().cpu()
    total = float(influence.abs().sum()) or 1.0
    kept = node_mask.cpu().nonzero().flatten().tolist()
    errors_end = graph.n_features + graph.n_layers * graph.n_pos
    selected = graph.active_features[graph.selected_features].tolist() if graph.n_features else []
    activations = graph.activation_values[graph.selected_features].tolist() if graph.n_features else []
    for index in kept:
        if index < graph.n_features:
            (layer, pos, feature), kind, act = selected[index], FEATURE, activations[index]
            found = _contexts_for(contexts, layer, feature)
            if found:
                data["contexts"][f"{layer}_{feature}"] = found
        elif index < errors_end:
            (layer, pos), feature, kind, act = divmod(index - graph.n_features, graph.n_pos), -1, ERROR, None
        elif index < errors_end + graph.n_pos:
            layer, pos, feature, kind, act = -1, index - errors_end, int(graph.input_tokens[index - errors_end]), \
                TOKEN, None
        else:
            k = index - errors_end - graph.n_pos
            layer, pos, feature, kind = graph.n_layers, graph.n_pos - 1, k, LOGIT
            act = float(graph.logit_probabilities[k])
        for key, value in zip(columns, (kind, layer, pos, feature, act if act is None else rounded(act),
                                        rounded(influence[index]), rounded(abs(float(influence[index])) / total)),
                              strict=True):
            columns[key].append(value)
    keep = node_mask.cpu()
    weights = adjacency[keep][:, keep]
    targets, sources = (edge_mask.cpu()[keep][:, keep] & (weights != 0)).nonzero(as_tuple=True)  # kept order
    data["src"], data["tgt"] = sources.tolist(), targets.tolist()
    data["w"] = [rounded(w) for w in weights[targets, sources].tolist()]
    return data


def graph_page(graph: Graph, tokenizer: Any = None, node_threshold: float = 0.8, edge_threshold: float = 0.98,
               contexts: Contexts | None = None, title: str | None = None, pruned: PruneResult | None = None,
               notes: Sequence[str] = ()) -> Page:
    """The attribution graph page of ``graph`` pruned at ``node_threshold`` / ``edge_threshold`` (`graph_data`).

    ``tokenizer`` labels the tokens and logits (without it they show as ids); ``contexts`` gives features' top
    activating contexts; ``pruned`` a `prune` result already computed; ``notes`` lines shown above the graph. The page
    is the HTML (a ``str``).

    Raises:
        InvalidInput: a graph whose fields disagree or come from another model than ``tokenizer``'s, NaN values.
    """
    data = graph_data(graph, tokenizer, node_threshold, edge_threshold, contexts, pruned)
    notes = list(notes)
    if graph.n_pos == 0:
        notes.append("This graph is empty: it holds no token, so there is nothing to draw.")
    elif not any(kind == FEATURE for kind in data["nodes"]["kind"]):
        notes.append("No feature node survives pruning: the graph shows tokens, errors and logits only.")
    if tokenizer is None and graph.n_pos and not notes:
        notes.append("No tokenizer given: tokens and logits are shown by id (nncanon view --tokenizer NAME).")
    if contexts is None and graph.n_pos:
        notes.append("No top activating contexts given: pass contexts= to show them beside a feature.")
    name = title if title is not None else f"Attribution graph: {graph.input_string!r}"
    return render("graph", name, data, notes)


def write_graph_page(graph: Graph, path: str | os.PathLike, tokenizer: Any = None, **options: Any) -> Path:
    """Write `graph_page` (``options``: its keyword arguments) to ``path``; returns the path."""
    return graph_page(graph, tokenizer, **options).write(path)


def bytes_per_node(page: Page) -> float:
    """The page's size in bytes over its graph's kept nodes (``math.nan`` for a page without nodes)."""
    count = page.html.count('"kind":[')
    if not count:
        return math.nan
    start = page.html.index('"kind":[') + len('"kind":[')
    nodes = page.html[start:page.html.index("]", start)].count(",") + 1
    return page.size / nodes
