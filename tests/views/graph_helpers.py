"""A random acyclic attribution graph of any size, in the node order of `nncanon.graphs.Graph` (for the views'
tests and their benchmark: no model needed)."""

from __future__ import annotations

import torch

from nncanon.graphs import Graph


def synthetic_graph(n_layers: int = 2, n_pos: int = 3, per_cell: int = 2, n_logits: int = 2, vocab: int = 50,
                    density: float = 0.5, seed: int = 0) -> Graph:
    """``per_cell`` features at every (layer, position); a feature reads the tokens and every feature and error of
    an earlier layer at its position or before; the logits read everything. Weights are standard normal."""
    generator = torch.Generator().manual_seed(seed)
    active = torch.tensor([[layer, pos, f] for layer in range(n_layers) for pos in range(n_pos)
                           for f in range(per_cell)], dtype=torch.long).reshape(-1, 3)
    n_features = len(active)
    n = n_features + (n_layers + 1) * n_pos + n_logits
    layer_of = torch.cat([active[:, 0], torch.arange(n_layers).repeat_interleave(n_pos), torch.full((n_pos,), -1),
                          torch.full((n_logits,), n_layers)])
    pos_of = torch.cat([active[:, 1], torch.arange(n_pos).repeat(n_layers), torch.arange(n_pos),
                        torch.full((n_logits,), n_pos - 1)])
    is_feature = torch.zeros(n, dtype=torch.bool)
    is_feature[:n_features] = True
    is_logit = torch.zeros(n, dtype=torch.bool)
    is_logit[n - n_logits:] = True
    allowed = (layer_of[None, :] < layer_of[:, None]) & (pos_of[None, :] <= pos_of[:, None])
    allowed &= (is_feature | is_logit)[:, None] & ~is_logit[None, :]
    keep = torch.rand(n, n, generator=generator) < density
    adjacency = torch.randn(n, n, generator=generator) * (allowed & keep)
    probabilities = torch.softmax(torch.randn(n_logits, generator=generator), 0)
    return Graph(input_string="synthetic", input_tokens=torch.randint(0, vocab, (n_pos,), generator=generator),
                 active_features=active, activation_values=torch.rand(n_features, generator=generator) + 0.1,
                 selected_features=torch.arange(n_features), adjacency_matrix=adjacency,
                 logit_targets=torch.randint(0, vocab, (n_logits,), generator=generator),
                 logit_probabilities=probabilities.sort(descending=True).values, n_layers=n_layers,
                 cfg={"model_type": "synthetic"})
