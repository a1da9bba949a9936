"""Memory of a graph: an estimate before the rows run, the memory available, and the batch that fits.

What a graph holds (bytes):

- the frozen forward, per batch row (a target of one backward pass), kept for the backward: per block the attention
  scores, probabilities and the frozen pattern under eager attention (``3 · heads · n²`` elements: the one term
  above linear in the positions); under sdpa none (the kernel keeps its output and log-sum-exp, the pattern is
  frozen through its query and key: `nncanon.graphs.replacement.PATTERN_INPUTS`), but the frozen query and key
  (``2 · n · d``) and, once per forward, the boolean masks transformers materialises where the mask is not plain
  causal (a sliding window, padding: ``2 · n²`` bytes, counted always); the stream-sized tensors (``~16 · n · d``;
  ``k`` times that on a model keeping ``k`` streams per position, ``hc_mult``/``hc_count``)
  and the MLP's (``4 · n · d_ff``, times the experts each token uses), and the head's logits (``2 · n · vocab``);
- the rows: ``(features + logits) × (active + (layers + 1) · n + logits)`` float32 (on the host, or in a file with
  ``offload="disk"``), and the adjacency matrix assembled from them (``n_nodes²``, ``n_nodes`` = selected features
  + (layers + 1) · n + logits; likewise).

`plan_batch` shrinks the batch until the forward fits the memory available on the model's device (CUDA: free memory;
CPU: ``MemAvailable``), so memory grows with the rows (linearly in the positions for a fixed number of feature
nodes) and not with the batch, and refuses (`GraphTooLarge`, with the estimate) where one row does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil
import torch

from ..errors import NncanonError


class GraphTooLarge(NncanonError, MemoryError):
    """The graph's estimated memory exceeds what the machine has available (the message gives both)."""


@dataclass
class MemoryEstimate:
    """A graph's estimated memory, in bytes.

    Attributes:
        per_row: The frozen forward's activations per batch row (on the model's device).
        batch: Batch rows of the frozen forward.
        rows: The rows and the assembled adjacency matrix (host memory, or a file with ``offload="disk"``).
        available: Memory available on the model's device (``limit``: as given).
        host_available: Host memory available (the rows' side).
        on_disk: Whether the rows go to a file.
    """

    per_row: int
    batch: int
    rows: int
    available: int
    host_available: int
    on_disk: bool

    @property
    def forward(self) -> int:
        return self.per_row * self.batch

    def __str__(self) -> str:
        where = "in a file" if self.on_disk else "host"
        return (f"memory estimate: frozen forward {_gib(self.forward)} ({self.batch} rows x {_gib(self.per_row)}; "
                f"{_gib(self.available)} available on the model's device), rows and adjacency {_gib(self.rows)} "
                f"({where}; {_gib(self.host_available)} host memory available)")


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def available(device: torch.device) -> int:
    """Bytes available on ``device``: CUDA's free memory, else the host's (``psutil``: ``MemAvailable``)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def per_row_bytes(model: Any, n_pos: int) -> int:
    """The frozen forward's activations of one batch row of ``n_pos`` positions (module docstring): under eager
    attention quadratic in ``n_pos`` (per attention sublayer of a block), under sdpa linear but for the masks'
    ``2 · n²`` bytes."""
    config = model.config.get_text_config()
    size = torch.finfo(next(model._module.parameters()).dtype).bits // 8
    d = config.hidden_size
    heads = _largest(config, ("num_attention_heads", "n_head")) or 1
    d_ff = _largest(config, ("intermediate_size", "n_inner", "ffn_dim")) or 4 * d
    experts = _largest(config, ("num_experts_per_tok",)) or 1
    streams = _largest(config, ("hc_mult", "hc_count")) or 1  # (hyper-connections: k streams per position)
    eager = (getattr(model.config, "_attn_implementation", None) or "eager") == "eager"
    attentions, mlps = _sublayers(model)
    pattern = 3 * heads * n_pos * n_pos if eager else 2 * n_pos * d  # (the probabilities, or the query and key)
    per_layer = attentions * pattern + 16 * n_pos * d * streams + 4 * n_pos * d_ff * (experts + mlps - 1)
    masks = 0 if eager else 2 * n_pos * n_pos  # (bytes: booleans, once per forward)
    return size * (len(model.layers) * per_layer + 2 * n_pos * config.vocab_size) + masks


def _sublayers(model: Any) -> tuple[int, int]:
    """Attention sublayers and MLPs per block (the first block's): LongCat-Flash's blocks run two attentions of the
    surface's attention class, and two dense MLPs (`nncanon.families.Family.frozen_sublayers`) beside its MoE."""
    attention = model.support().layers[0].attention
    block = model.layers[0]._module
    attentions = sum(type(module).__name__ == attention for module in block.modules()) if attention else 1
    return max(1, attentions), 1 + len(model.family.frozen_sublayers)


def _largest(config: Any, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` the config has as a number; where it varies per layer (a per-layer config, a list),
    the largest."""
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:  # (a config whose attribute varies per layer refuses the global read)
            layers = getattr(config, "per_layer_config", None) or []
            value = [getattr(layer, name, None) for layer in layers]
        if isinstance(value, (list, tuple)):
            value = max((v for v in value if isinstance(v, int)), default=None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def plan_batch(model: Any, n_pos: int, n_rows: int, n_cols: int, batch: int, *, offload: str | None,
               limit: int | None, verbose: bool, n_nodes: int | None = None) -> tuple[int, MemoryEstimate]:
    """The batch to run (at most ``batch``) and the estimate; `GraphTooLarge` where one row does not fit.

    ``n_rows``, ``n_cols``: the rows to compute and their length; ``n_nodes``: the assembled adjacency matrix's
    side (the graph's nodes: the selected features, not every active one; default ``n_cols``); ``limit``: the bytes
    available on the model's device and the host (default: measured).
    """
    device = next(model._module.parameters()).device
    on_device = available(device) if limit is None else limit
    host = available(torch.device("cpu")) if limit is None else limit
    per_row = per_row_bytes(model, n_pos)
    side = n_cols if n_nodes is None else n_nodes
    rows = 4 * (n_rows * n_cols + side * side)
    estimate = MemoryEstimate(per_row, batch, rows, on_device, host, offload == "disk")
    shared = device.type == "cpu" and not estimate.on_disk  # the rows share the host's memory with the forward
    budget = on_device - (rows if shared else 0)
    fitting = budget // max(per_row, 1)
    if fitting < 1 or (not estimate.on_disk and rows > host):
        raise GraphTooLarge(f"this graph needs more memory than is available: {estimate} (a shorter prompt, "
                            "max_feature_nodes, or offload='disk' for the rows)")
    estimate.batch = int(min(batch, fitting))
    if verbose:
        print(estimate)
    return estimate.batch, estimate
