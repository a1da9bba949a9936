"""Pruning a graph by influence on the logits, and the graph's replacement and completeness scores (circuit-tracer's
``prune_graph`` and ``compute_graph_scores``, the same arithmetic).

A node's influence is its total (direct and indirect) effect on the logits, weighted by their probabilities, through
the adjacency matrix with each row normalised to absolute values summing to 1: ``w · (A + A² + ...)`` with ``w`` the
logit probabilities on the logit nodes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import InvalidArgument
from .graph import Graph


class PruneResult(NamedTuple):
    """``node_mask [n_nodes]`` and ``edge_mask [n_nodes, n_nodes]`` of what is kept, and each node's cumulative
    influence score ``[n_nodes]`` (its rank's share of the total influence, from the most influential)."""

    node_mask: torch.Tensor
    edge_mask: torch.Tensor
    cumulative_scores: torch.Tensor


def normalize_matrix(matrix: torch.Tensor) -> torch.Tensor:
    """``|A|`` with each row divided by its sum (rows of zeros stay zero)."""
    normalized = matrix.abs()
    return normalized / normalized.sum(dim=1, keepdim=True).clamp(min=1e-10)


def compute_influence(matrix: torch.Tensor, logit_weights: torch.Tensor, max_iter: int = 1000) -> torch.Tensor:
    """``w · (A + A² + ...)``, summed until the product vanishes (the graph is acyclic)."""
    current = logit_weights @ matrix
    influence = current
    for _ in range(max_iter):
        if not current.any():
            return influence
        current = current @ matrix
        influence = influence + current
    raise InvalidArgument(f"the influence did not converge in {max_iter} iterations: the adjacency matrix has a cycle")


def _logit_weights(graph: Graph) -> torch.Tensor:
    weights = torch.zeros(graph.adjacency_matrix.shape[0], device=graph.adjacency_matrix.device)
    weights[-graph.n_logits:] = graph.logit_probabilities.to(weights)
    return weights


def node_influence(graph: Graph) -> torch.Tensor:
    """Each node's influence on the logits ``[n_nodes]``."""
    return compute_influence(normalize_matrix(graph.adjacency_matrix), _logit_weights(graph))


def _threshold(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The score above which the sorted scores hold ``fraction`` of their total."""
    ordered = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(ordered, dim=0) / torch.sum(ordered)
    index = min(int(torch.searchsorted(cumulative, fraction)), len(cumulative) - 1)
    return ordered[index]


def prune(graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> PruneResult:
    """Keep the nodes holding ``node_threshold`` of the influence and the edges holding ``edge_threshold`` of the
    edge influence among them, then drop feature and error nodes left without outgoing edges and features left
    without incoming ones, until nothing changes; tokens and logits are always kept."""
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise InvalidArgument(f"{name} must be between 0.0 and 1.0, not {value}")
    n_tokens, n_logits, n_features = graph.n_pos, graph.n_logits, graph.n_features
    weights = _logit_weights(graph)
    influence = compute_influence(normalize_matrix(graph.adjacency_matrix), weights)
    node_mask = influence >= _threshold(influence, node_threshold)
    node_mask[-n_logits - n_tokens:] = True
    pruned = graph.adjacency_matrix.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    normalized = normalize_matrix(pruned)
    edge_scores = normalized * (compute_influence(normalized, weights) + weights)[:, None]
    edge_mask = edge_scores >= _threshold(edge_scores.flatten(), edge_threshold)
    inner = slice(None, -n_logits - n_tokens)
    old = node_mask.clone()
    node_mask[inner] &= edge_mask[:, inner].any(0)
    node_mask[:n_features] &= edge_mask[:n_features].any(1)
    while not torch.equal(node_mask, old):
        old[:] = node_mask
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[inner] &= edge_mask[:, inner].any(0)
        node_mask[:n_features] &= edge_mask[:n_features].any(1)
    ordered, order = torch.sort(influence, descending=True)
    cumulative = torch.zeros_like(influence)
    cumulative[order] = torch.cumsum(ordered, dim=0) / torch.sum(ordered)
    return PruneResult(node_mask, edge_mask, cumulative)


def graph_scores(graph: Graph) -> tuple[float, float]:
    """``(replacement, completeness)``: the share of the tokens' and errors' influence on the logits that is the
    tokens' (through features), and the influence-weighted share of every node's inputs that is not from errors."""
    errors = slice(graph.n_features, graph.n_features + graph.n_layers * graph.n_pos)
    tokens = slice(errors.stop, errors.stop + graph.n_pos)
    weights = _logit_weights(graph)
    normalized = normalize_matrix(graph.adjacency_matrix)
    influence = compute_influence(normalized, weights)
    token, error = influence[tokens].sum(), influence[errors].sum()
    replacement = token / (token + error)
    non_error = 1 - normalized[:, errors].sum(dim=-1)
    output = influence + weights
    completeness = (non_error * output).sum() / output.sum()
    return float(replacement), float(completeness)


#: circuit-tracer's names.
prune_graph = prune
compute_graph_scores = graph_scores
