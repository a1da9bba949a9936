"""The attribution graph record: circuit-tracer's `Graph`, field for field and in its node order.

Nodes, in the order of the adjacency matrix's rows and columns (``n_pos`` positions, ``n_layers`` blocks):

1. the selected features, in the order of ``selected_features`` (indices into ``active_features``; all of them
   unless ``max_feature_nodes`` cut the list): ``len(selected_features)`` nodes;
2. the error nodes, layer-major: error ``(layer, pos)`` is node ``n_features + layer · n_pos + pos``;
3. the token nodes: token ``pos`` is node ``n_features + n_layers · n_pos + pos``;
4. the logit nodes, in the order of ``logit_targets`` (most probable first).

``adjacency_matrix[target, source]`` is the direct effect of the source on the target in the frozen replacement
model (`nncanon.graphs.attribute`): rows of error and token nodes are zero (they have no inputs), and so are the
columns of logit nodes.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from ..errors import InvalidInput


@dataclass
class Graph:
    """An attribution graph (circuit-tracer's ``Graph`` fields; node order in the module docstring).

    Attributes:
        input_string: The prompt, decoded.
        input_tokens: ``[n_pos]`` token ids.
        active_features: ``[n_active, 3]`` (layer, position, feature) of every active transcoder feature, sorted
            by layer, then position, then feature.
        activation_values: ``[n_active]`` their activations.
        selected_features: ``[n_features]`` indices into ``active_features`` of the feature nodes.
        adjacency_matrix: ``[n_nodes, n_nodes]``, rows targets, columns sources.
        logit_targets: ``[n_logits]`` the token ids of the logit nodes.
        logit_probabilities: ``[n_logits]`` their probabilities at the last position.
        n_layers: Blocks of the model (error nodes per position).
        scan: An identifier of the transcoder set (circuit-tracer's ``scan``), or ``None``.
        cfg: What the graph was built from: the model's name and widths, the frozen values (plain data);
            ``in_errors``: per block, the sublayers no transcoder maps whose outputs its error nodes hold besides the
            MLP's (LongCat-Flash's ``["mlps.0", "mlps.1"]``; ``[]`` elsewhere).
    """

    input_string: str
    input_tokens: torch.Tensor
    active_features: torch.Tensor
    activation_values: torch.Tensor
    selected_features: torch.Tensor
    adjacency_matrix: torch.Tensor
    logit_targets: torch.Tensor
    logit_probabilities: torch.Tensor
    n_layers: int
    scan: str | list[str] | None = None
    cfg: dict[str, Any] = field(default_factory=dict)

    # -- sizes and node indices -------------------------------------------------------------------------

    @property
    def n_pos(self) -> int:
        """Positions of the prompt."""
        return len(self.input_tokens)

    @property
    def n_features(self) -> int:
        """Feature nodes (selected features)."""
        return len(self.selected_features)

    @property
    def n_logits(self) -> int:
        """Logit nodes."""
        return len(self.logit_targets)

    @property
    def logit_tokens(self) -> torch.Tensor:
        """circuit-tracer 0.4's name of ``logit_targets``."""
        return self.logit_targets

    def error_node(self, layer: int, pos: int) -> int:
        """The node index of the error at ``(layer, pos)``."""
        return self.n_features + layer * self.n_pos + pos

    def token_node(self, pos: int) -> int:
        """The node index of the token at ``pos``."""
        return self.n_features + self.n_layers * self.n_pos + pos

    def logit_node(self, k: int) -> int:
        """The node index of the ``k``-th logit target."""
        return self.n_features + (self.n_layers + 1) * self.n_pos + k

    @property
    def n_nodes(self) -> int:
        """All nodes: features, errors, tokens, logits."""
        return self.n_features + (self.n_layers + 1) * self.n_pos + self.n_logits

    # -- saving -----------------------------------------------------------------------------------------

    def to(self, device: torch.device | str) -> Graph:
        """The graph with its tensors on ``device`` (in place, returned)."""
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, torch.Tensor):
                setattr(self, item.name, value.to(device))
        return self

    def to_pt(self, path: str | os.PathLike) -> None:
        """Save as a ``.pt`` file of plain fields (circuit-tracer's ``Graph.to_pt`` layout, ``logit_tokens`` too)."""
        record = asdict(self)
        record["logit_tokens"] = self.logit_targets
        torch.save(record, path)

    @classmethod
    def from_pt(cls, path: str | os.PathLike, map_location: str | torch.device = "cpu",
                weights_only: bool = False) -> Graph:
        """A graph saved by `to_pt` (or circuit-tracer's ``to_pt``, whose ``cfg`` is read for ``n_layers``).
        ``weights_only``: unpickle tensors and plain data only (`to_pt`'s files; a file from elsewhere then runs no
        code, and circuit-tracer's, holding its config object, is refused)."""
        record = torch.load(path, map_location=map_location, weights_only=weights_only)
        if not isinstance(record, dict) or "adjacency_matrix" not in record:
            name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else "the file"
            raise InvalidInput(f"{name} is not a saved attribution graph (no adjacency_matrix)")
        targets = record.get("logit_targets", record.get("logit_tokens"))
        if targets is not None and not isinstance(targets, torch.Tensor):  # circuit-tracer 0.5's LogitTarget list
            targets = torch.tensor([getattr(t, "vocab_idx", t) for t in targets])
        cfg = record.get("cfg") or {}
        n_layers = record.get("n_layers") or (cfg.get("n_layers") if isinstance(cfg, dict) else cfg.n_layers)
        return cls(input_string=record.get("input_string", ""), input_tokens=record["input_tokens"],
                   active_features=record["active_features"], activation_values=record["activation_values"],
                   selected_features=record["selected_features"], adjacency_matrix=record["adjacency_matrix"],
                   logit_targets=targets, logit_probabilities=record["logit_probabilities"], n_layers=int(n_layers),
                   scan=record.get("scan"), cfg=cfg if isinstance(cfg, dict) else {"n_layers": int(n_layers)})
