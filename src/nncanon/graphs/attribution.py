"""`build`: an attribution graph of a prompt over per-layer or cross-layer transcoders, circuit-tracer's algorithm
on the frozen replacement model (`nncanon.graphs.replacement`).

Conventions (circuit-tracer's): a feature's activation is its transcoder's (JumpReLU strict: ``pre > threshold``);
a feature target is the encoder pre-activation without ``b_enc`` (``x · W_enc[:, f]``, ``x`` the value the
transcoder reads: `nncanon.graphs.coders.READS`); a feature source is ``activation · W_dec[f]`` at the MLP's output
(a cross-layer feature's: at every MLP output it decodes to); an error node is the MLP's output less every
reconstruction into it at one (layer, position); position 0's features and errors are zeroed where the prompt
starts with a special token (its MLP outputs are then constants of the frozen model); logit targets are the most
probable tokens after the family's soft-cap until their probabilities sum to ``desired_logit_prob`` (at most
``max_n_logits``), each target the head's output (before the soft-cap) dotted with the one-hot of the token less the
vocabulary's mean: ``W_U[t] - mean(W_U)`` applied to the final norm's output; a token node's vector is
``model.token_embeddings`` at its position (the token's embedding, with the family's scale where the embedding module
applies it; absolute position embeddings are constants of the frozen model, in every target's bias term), or the
stream entering block 0 where an embedding norm sits before it (`nncanon.graphs.replacement.Plan.tokens`).

Each row of the adjacency matrix is one backward pass: a batch of at most ``batch_size`` copies of the prompt (as
many as fit the memory: `nncanon.graphs.memory`) runs the frozen model once, target ``b`` reads batch row ``b``, and
the gradient at each leaf (the token nodes' vectors, each block's MLP output) times each source's vector is the row.
Batch row 0 of that run has every leaf at its clean value: the graph's forward check (`_check_forward`).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy
import torch

from .. import files
from ..errors import CannotWrite, InvalidArgument, InvalidDictionary, InvalidInput, ValueNotAvailable
from .coders import Coders, check_transcoders
from .graph import Graph
from .memory import GraphTooLarge, plan_batch
from .replacement import NO_CACHE, Clean, Plan, clean_run, frozen_body, frozen_run, plan_of


@dataclass
class Setup:
    """Everything a graph is computed from (kept for `nncanon.graphs.verify`).

    Attributes:
        model: The model.
        ids: ``[1, n]`` the prompt's token ids.
        plan, clean: The frozen model and the clean run.
        transcoders: The transcoder set (`nncanon.graphs.coders.Coders`).
        active: ``[n_active, 3]`` (layer, pos, feature), sorted; values: ``[n_active]`` activations.
        sources: ``[n_active, R, d]`` each active feature's source vectors ``activation · W_dec[f]`` into its layer
            and the ``R - 1`` after it (``R`` 1 for per-layer transcoders, ``n_layers`` for a cross-layer one).
        errors: ``[n_layers, n, d]`` the error nodes' vectors at the MLP leaves (position 0 zeroed where
            ``zero_bos``).
        leaves: Per block, the MLP output leaf's value ``[n, d]`` (the clean output less a skip connection; zero at a
            block without an MLP, whose error nodes are zero too); then each sublayer no transcoder maps
            (`nncanon.graphs.replacement.Plan.sublayers`), its clean output ``[n, d]``.
        folded: Per sublayer of ``plan.sublayers``, ``(layer, vector [n, d])``: its clean output (position 0 zeroed
            where ``zero_bos``), part of block ``layer``'s error node, at its own leaf: the error node's edges are
            the sum of the effects of its vectors, each where the block adds it.
        logit_ids, logit_probs: The logit targets and their probabilities.
        zero_bos: Whether position 0's features and errors are zeroed.
    """

    model: Any
    ids: torch.Tensor
    plan: Plan
    clean: Clean
    transcoders: Coders
    active: torch.Tensor
    values: torch.Tensor
    sources: torch.Tensor
    errors: torch.Tensor
    leaves: list[torch.Tensor]
    logit_ids: torch.Tensor
    logit_probs: torch.Tensor
    zero_bos: bool
    folded: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def n_layers(self) -> int:
        return len(self.plan.steps)

    @property
    def n_pos(self) -> int:
        return self.ids.shape[1]


def token_ids(model: Any, prompt: Any) -> torch.Tensor:
    """``[1, n]`` token ids of a string, a list of ids or a 1-D/``[1, n]`` tensor; `InvalidInput` if empty."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidInput("the prompt is empty: an attribution graph needs at least one token")
        ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    elif isinstance(prompt, torch.Tensor):
        ids = prompt.reshape(1, -1) if prompt.dim() == 1 or (prompt.dim() == 2 and prompt.shape[0] == 1) else None
        if ids is None:
            raise InvalidInput(f"a graph is of one prompt: token ids of shape [n] or [1, n], not {tuple(prompt.shape)}")
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        ids = torch.tensor([list(prompt)], dtype=torch.long)
    else:
        raise InvalidInput(f"the prompt must be a string or token ids, not a {type(prompt).__name__}")
    if ids.shape[1] == 0:
        raise InvalidInput("the prompt is empty: an attribution graph needs at least one token")
    return ids.to(model.device if hasattr(model, "device") else "cpu")


def _starts_special(model: Any, ids: torch.Tensor) -> bool:
    tokenizer = getattr(model, "tokenizer", None)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return int(ids[0, 0]) in special


def setup(model: Any, prompt: Any, transcoders: Any, *, max_n_logits: int = 10, desired_logit_prob: float = 0.95,
          zero_bos: bool | None = None, remote: Any = None) -> Setup:
    """The clean run, the active features, error vectors and logit targets of ``prompt``."""
    coders = check_transcoders(model, transcoders)
    plan = plan_of(model, coders.reads)
    ids = token_ids(model, prompt)
    clean = clean_run(model, ids, plan, remote)
    if not torch.isfinite(clean.logits).all():
        raise InvalidInput("the model's logits on this prompt hold NaN or infinite values: no graph of them")
    zero_bos = _starts_special(model, ids) if zero_bos is None else zero_bos
    start = 1 if zero_bos else 0
    n, d = clean.embeddings.shape
    n_layers = len(plan.steps)
    for layer in range(n_layers):
        widths = (clean.inputs[layer].shape[-1], clean.outputs[layer].shape[-1])
        if widths != (d, d):
            raise InvalidDictionary(f"layers[{layer}]'s transcoder input ({plan.reads[layer]}) and output "
                                    f"({plan.writes}) are {widths[0]} and {widths[1]} wide, not the model's width {d} "
                                    "that its transcoders map")
    features: list[torch.Tensor | None] = []
    for layer in range(n_layers):
        if not coders.present(layer):
            features.append(None)
            continue
        found = coders.encode(layer, clean.inputs[layer])
        if not torch.isfinite(found).all():
            raise InvalidInput(f"transcoder {layer}'s features on this prompt hold NaN or infinite values")
        features.append(found)
    reconstructions = coders.reconstructions(features, clean.inputs)
    actives, values, sources, leaves = [], [], [], []
    errors = torch.zeros(n_layers, n, d, dtype=clean.embeddings.dtype, device=clean.embeddings.device)
    for layer in range(n_layers):
        out = clean.outputs[layer]
        if features[layer] is None:
            errors[layer, start:] = out[start:]
            leaves.append(out)
            continue
        skip = coders.skip(layer, clean.inputs[layer])
        leaves.append(out - skip.to(out.dtype) if skip is not None else out)
        errors[layer, start:] = (out - reconstructions[layer].to(out.dtype))[start:]
        found = features[layer]
        found[:start] = 0
        pos, feature = found.nonzero(as_tuple=True)
        actives.append(torch.stack([torch.full_like(pos, layer), pos, feature], dim=1))
        values.append(found[pos, feature])
        sources.append((found[pos, feature, None, None] * coders.decoders(layer, feature)).to(out.dtype))
    folded = []
    for layer, step, _, key in plan.sublayers:  # (the sublayers no transcoder maps: in their block's error node)
        out = clean.frozen[layer][step][key][0][0]
        leaves.append(out)
        folded.append((layer, torch.cat([torch.zeros_like(out[:start]), out[start:]])))
    empty = torch.zeros(0, 3, dtype=torch.long, device=clean.embeddings.device)
    logits = clean.logits[-1].float()
    probs = torch.softmax(logits, dim=-1)
    top_p, top_ids = torch.topk(probs, min(max_n_logits, probs.shape[-1]))
    cutoff = int(torch.searchsorted(torch.cumsum(top_p, 0), torch.tensor(desired_logit_prob,
                                                                          device=top_p.device))) + 1
    return Setup(model=model, ids=ids, plan=plan, clean=clean, transcoders=coders,
                 active=torch.cat(actives) if actives else empty,
                 values=torch.cat(values) if values else torch.zeros(0, device=empty.device),
                 sources=torch.cat(sources) if sources else torch.zeros(0, coders.reach, d, device=empty.device),
                 errors=errors, leaves=leaves, logit_ids=top_ids[:cutoff], logit_probs=top_p[:cutoff],
                 zero_bos=zero_bos, folded=folded)


def target_values(s: Setup, inputs: list[torch.Tensor], head: torch.Tensor, features: torch.Tensor,
                  logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The targets' values on a frozen run: ``features`` (indices into ``s.active``) then ``logits`` (indices into
    ``s.logit_ids``), target ``i`` read at batch row ``rows[i]``; ``[len(features) + len(logits)]``."""
    out = []
    if len(features):
        f_rows = rows[: len(features)]
        layers, positions, ids = s.active[features].unbind(1)
        values = torch.zeros(len(features), dtype=torch.float32, device=head.device)
        for layer in layers.unique().tolist():
            mask = layers == layer
            x = inputs[layer][f_rows[mask], positions[mask]].to(s.transcoders.dtype(layer))
            values[mask] = (x * s.transcoders.encoder(layer, ids[mask]).T).sum(-1).float()
        out.append(values)
    if len(logits):
        last = head[rows[len(features):], -1].float()
        out.append(last[torch.arange(len(logits)), s.logit_ids[logits]] - last.mean(-1))
    return torch.cat(out) if out else torch.zeros(0)


def gradient_rows(s: Setup, grads: list[torch.Tensor], n: int) -> torch.Tensor:
    """Rows ``[n, n_active + (n_layers + 1) · n_pos]`` from the gradients at the leaves (batch rows ``:n``):
    ``grads[0]`` at the stream into block 0 ``[B, n_pos, d]``, ``grads[1 + layer]`` at each MLP output, then at each
    sublayer output folded into an error node (``s.folded``)."""
    g_embed, g_out = grads[0][:n].float(), [g[:n].float() for g in grads[1:1 + s.n_layers]]
    layers, positions, _ = s.active.unbind(1)
    feature_cols = torch.zeros(n, len(s.active), device=g_embed.device)
    start = 0
    found, counts = torch.unique_consecutive(layers, return_counts=True)
    for layer, count in zip(found.tolist(), counts.tolist(), strict=True):
        at = slice(start, start + count)  # (the active features are sorted by layer)
        start += count
        for r in range(min(s.sources.shape[1], len(g_out) - layer)):  # into layer + r
            feature_cols[:, at] += _dots(g_out[layer + r], positions[at], s.sources[at, r].float())
    error_cols = torch.stack([(g * e.float()[None]).sum(-1) for g, e in zip(g_out, s.errors, strict=True)], dim=1)
    for (layer, vector), g in zip(s.folded, grads[1 + s.n_layers:], strict=True):
        error_cols[:, layer] += (g[:n].float() * vector.float()[None]).sum(-1)
    token_cols = (g_embed * s.clean.embeddings.float()[None]).sum(-1)
    return torch.cat([feature_cols, error_cols.flatten(1), token_cols], dim=1)


#: Elements of one block of `_dots`' products (a block stays in the processor's cache).
DOTS_BLOCK = 1 << 18


def _dots(g: torch.Tensor, positions: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """``(g[:, positions] * vectors[None]).sum(-1)``: ``[B, k]`` from ``g`` ``[B, n_pos, d]``, ``positions`` ``[k]``
    and ``vectors`` ``[k, d]``, the same products and sums (each column's bit for bit) a block of columns at a time,
    without the ``[B, k, d]`` product in memory."""
    batch, _, d = g.shape
    out = torch.empty(batch, len(positions), dtype=g.dtype, device=g.device)
    step = max(1, DOTS_BLOCK // (batch * d))
    for start in range(0, len(positions), step):
        block = g.index_select(1, positions[start:start + step])
        out[:, start:start + step] = block.mul_(vectors[start:start + step]).sum(-1)
    return out


class _Rows:
    """One frozen forward of ``batch`` copies of the prompt, kept for many backward passes."""

    def __init__(self, s: Setup, batch: int) -> None:
        self.s = s
        self.batch = batch
        embed = s.clean.embeddings
        self.leaves = [embed.expand(batch, -1, -1).clone().requires_grad_()]
        self.leaves += [leaf.expand(batch, -1, -1).clone().requires_grad_() for leaf in s.leaves]
        with torch.enable_grad():
            self.inputs, self.head = frozen_run(s.model, s.ids, s.plan, s.clean, self.leaves[0], self.leaves[1:],
                                                s.transcoders)

    def __call__(self, features: torch.Tensor, logits: torch.Tensor, retain: bool = True) -> torch.Tensor:
        n = len(features) + len(logits)
        rows = torch.arange(n, device=self.head.device)
        with torch.enable_grad():
            targets = target_values(self.s, self.inputs, self.head, features, logits, rows)
            grads = torch.autograd.grad(targets.sum(), self.leaves, retain_graph=retain, allow_unused=True,
                                        materialize_grads=True)
        return gradient_rows(self.s, list(grads), n)


def batch_leaves(s: Setup, batch: int) -> list[torch.Tensor]:
    """The frozen run's leaves for ``batch`` copies of the prompt, each at its clean value (made inside a remote
    trace, on the server): the token nodes' vectors ``[batch, n, d]``, then each of ``s.leaves``."""
    return [value.expand(batch, -1, -1).clone() for value in [s.clean.embeddings, *s.leaves]]


class _RemoteRows:
    """`_Rows` for a remote model: each call is one request (``remote`` as ``model.trace`` takes it) that runs the
    frozen forward of ``batch`` copies on leaves made there, the targets' backward, and returns the rows; the first
    request also returns batch row 0's transcoder inputs and head output (every leaf at its clean value), checked
    here against the clean run's (`_check_forward`) before any row is kept."""

    def __init__(self, s: Setup, batch: int, remote: Any) -> None:
        self.s, self.batch, self.remote = s, batch, remote
        self.checked = False

    def __call__(self, features: torch.Tensor, logits: torch.Tensor, retain: bool = True) -> torch.Tensor:
        s, batch, first = self.s, self.batch, not self.checked
        n = len(features) + len(logits)
        forward: list[torch.Tensor] = []
        with torch.enable_grad(), s.model.trace(s.ids.expand(batch, -1), remote=self.remote, **NO_CACHE):
            leaves = [leaf.requires_grad_() for leaf in batch_leaves(s, batch)]
            inputs, head = frozen_body(s.model, s.plan, s.clean, leaves[0], leaves[1:], s.transcoders)
            if first:  # (row 0 of the frozen run, detached: the forward check's values)
                forward.extend([x[0].detach().save() for x in inputs] + [head[0].detach().save()])
            targets = target_values(s, inputs, head, features, logits, torch.arange(n, device=head.device))
            grads = torch.autograd.grad(targets.sum(), leaves, allow_unused=True, materialize_grads=True)
            rows = gradient_rows(s, list(grads), n).save()
        if first:
            _check_forward(s, forward[:-1], forward[-1])
            self.checked = True
        return rows


def build(model: Any, prompt: Any, transcoders: Any, *, max_n_logits: int = 10, desired_logit_prob: float = 0.95,
          max_feature_nodes: int | None = None, batch_size: int = 64, offload: str | None = None,
          update_interval: int = 4, zero_bos: bool | None = None, verbose: bool = False,
          memory_limit: int | None = None, remote: Any = None, offload_dir: str | os.PathLike | None = None
          ) -> Graph:
    """`nncanon.graphs.attribute` without the model's linearity proof (`nncanon.graphs.proof.support`)."""
    store = _Store(offload, offload_dir)  # (a folder that cannot hold the rows refused before any work)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgument(f"batch_size must be a positive int, not {batch_size!r}")
    s = setup(model, prompt, transcoders, max_n_logits=max_n_logits, desired_logit_prob=desired_logit_prob,
              zero_bos=zero_bos, remote=remote)
    n_active, n_logits = len(s.active), len(s.logit_ids)
    n_pos, n_layers = s.n_pos, s.n_layers
    offset = n_active + (n_layers + 1) * n_pos
    total = offset + n_logits
    n_features = n_active if max_feature_nodes is None else min(max_feature_nodes, n_active)
    batch = max(1, min(batch_size, max(n_logits, n_features)))
    batch, _ = plan_batch(model, n_pos, n_features + n_logits, total, batch, offload=offload, limit=memory_limit,
                          verbose=verbose, n_nodes=n_features + (n_layers + 1) * n_pos + n_logits)
    if remote:
        rows: _Rows | _RemoteRows = _RemoteRows(s, batch, remote)  # (checked at its first request)
    else:
        rows = _Rows(s, batch)
        _check_forward(s, [x[0] for x in rows.inputs], rows.head[0])
    edges = store.zeros(n_features + n_logits, total)
    row_node = torch.zeros(n_features + n_logits, dtype=torch.long)
    no = torch.zeros(0, dtype=torch.long, device=s.active.device)
    for start in range(0, n_logits, batch):
        chunk = torch.arange(start, min(start + batch, n_logits), device=s.active.device)
        edges[start:start + len(chunk), :offset] = rows(no, chunk).cpu()
        row_node[start:start + len(chunk)] = chunk.cpu() + offset
    filled, visited = n_logits, torch.zeros(n_active, dtype=torch.bool)
    while int(visited.sum()) < n_features:
        if n_features == n_active:
            pending = torch.arange(n_active)
        else:
            influence = partial_influences(edges[:filled], s.logit_probs.cpu(), row_node[:filled], total)
            ranked = torch.argsort(influence[:n_active], descending=True)
            pending = ranked[~visited[ranked]][: min(update_interval * batch, n_features - int(visited.sum()))]
        for start in range(0, len(pending), batch):
            chunk = pending[start:start + batch]
            edges[filled:filled + len(chunk), :offset] = rows(chunk.to(s.active.device), no).cpu()
            row_node[filled:filled + len(chunk)] = chunk
            visited[chunk] = True
            filled += len(chunk)
    del rows
    selected = torch.where(visited)[0]
    columns = torch.cat([selected, torch.arange(n_active, total)]) if n_features < n_active else None
    size = n_features + (n_layers + 1) * n_pos + n_logits
    adjacency = store.zeros(size, size)
    order = row_node.argsort()  # features (in the order of `selected`), then logits
    for start in range(0, len(order), 256):  # (a block of rows at a time: no second copy of the rows)
        block = edges[order[start:start + 256]]
        block = block[:, columns] if columns is not None else block
        target = torch.arange(start, min(start + 256, len(order)))
        target = torch.where(target < n_features, target, target - n_features + size - n_logits)
        adjacency[target] = block
    return Graph(input_string=_decode(model, s.ids), input_tokens=s.ids[0].cpu(), active_features=s.active.cpu(),
                 activation_values=s.values.float().cpu(), selected_features=selected,
                 adjacency_matrix=adjacency, logit_targets=s.logit_ids.cpu(),
                 logit_probabilities=s.logit_probs.float().cpu(), n_layers=n_layers,
                 scan=None, cfg={"model_type": model.config.model_type, "n_layers": n_layers,
                                 "attn_implementation": getattr(model.config, "_attn_implementation", None),
                                 "d_model": s.clean.embeddings.shape[-1], "zero_bos": s.zero_bos,
                                 "reads": list(s.plan.reads), "tokens": s.plan.tokens,
                                 "cross_layer": s.transcoders.clt is not None, "batch": batch,
                                 "frozen": [[name for name in steps if name in s.clean.frozen[i]]
                                            for i, steps in enumerate(s.plan.steps)],
                                 "in_errors": [[path for at, _, path, _ in s.plan.sublayers if at == i]
                                               for i in range(n_layers)]})


#: The forward check's tolerance (relative to the clean value's largest entry), as the proof's.
FORWARD_RTOL = 1e-4


def _check_forward(s: Setup, inputs: list[torch.Tensor], head: torch.Tensor) -> None:
    """Every graph's forward check, on batch row 0 of the rows' frozen run (every leaf at its clean value), local or
    remote: the transcoders' inputs ``inputs`` (per block ``[n, d]``) and the head's output ``head`` ``[n, vocab]``
    are the clean run's surface values; `ValueNotAvailable` with the numbers where not (a read the frozen model
    does not compute as the surface serves it)."""
    worst = []
    with torch.no_grad():
        for layer, x in enumerate(inputs):
            error = float((x.double() - s.clean.inputs[layer].double()).abs().max()
                          / (s.clean.inputs[layer].double().abs().max() + 1e-12))
            worst.append((error, f"layers[{layer}]'s transcoder input ({s.plan.reads[layer]})"))
        worst.append((float((head.double() - s.clean.head.double()).abs().max()
                            / (s.clean.head.double().abs().max() + 1e-12)), "the head's output"))
    error, where = max(worst)
    if not error <= FORWARD_RTOL:  # (NaN fails too)
        raise ValueNotAvailable(f"no attribution graph on this {s.model.config.model_type} model with these "
                                f"transcoders: on the frozen replacement model {where} differs from the clean run's "
                                f"by {error:.2e} relative (tolerance {FORWARD_RTOL:.0e})")


#: What ``offload`` may be: rows on the host (``None``, ``"cpu"``) or in a memory-mapped file (``"disk"``).
OFFLOAD = (None, "cpu", "disk")


def check_offload(offload: str | None, folder: str | os.PathLike | None) -> Path | None:
    """The folder of ``offload="disk"``'s files (``folder``, else ``None``: the temporary folder, ``TMPDIR``
    honoured), checked before any work: `InvalidArgument` for a folder without ``offload="disk"``, `CannotWrite` for
    one that is missing, not a folder or read-only (or no usable temporary folder at all)."""
    if offload not in OFFLOAD:
        raise InvalidArgument(f"offload={offload!r}: one of {OFFLOAD} (finished rows on the host; 'disk': in a "
                              "memory-mapped file)")
    if folder is not None and offload != "disk":
        raise InvalidArgument(f"offload_dir={os.fspath(folder)!r} is for offload='disk' (offload={offload!r})")
    if offload != "disk":
        return None
    try:
        where = Path(folder) if folder is not None else Path(tempfile.gettempdir())
    except OSError as error:  # (no usable temporary folder at all)
        raise CannotWrite(f"offload='disk': no temporary folder to hold the rows' files ({error}); give offload_dir= "
                          "(nncanon graph --offload-dir) a writable folder, or set TMPDIR") from None
    if not where.is_dir():
        raise CannotWrite(f"offload='disk': the folder of the rows' files {where} does not exist or is not a folder; "
                          "give offload_dir= (nncanon graph --offload-dir) a folder, or set TMPDIR")
    problem = files.unwritable(where)
    if problem is not None:
        raise CannotWrite(f"offload='disk': {problem} (the folder of the rows' files); give offload_dir= "
                          "(nncanon graph --offload-dir) a writable folder, or set TMPDIR")
    return Path(folder) if folder is not None else None


class _Store:
    """Where the rows and the adjacency matrix live: host memory, or (``"disk"``) memory-mapped files in ``folder``
    (default: the temporary folder, ``TMPDIR`` honoured), deleted when the tensors are. Each file's blocks are
    allocated before it is mapped, so a full disk is `GraphTooLarge` naming the folder now, not a crash at a later
    write into the mapping; a folder that is missing, not a folder or read-only is `CannotWrite`. In host memory a
    page is taken only once written: the adjacency matrix's rows of error and token nodes, ``(layers + 1) · n`` of
    its ``n_nodes`` rows, are zero and never written, so building a graph holds its written rows (linear in the
    positions), not ``n_nodes²`` (quadratic) until it is read whole."""

    def __init__(self, offload: str | None, folder: str | os.PathLike | None = None) -> None:
        self.disk = offload == "disk"
        self.folder = check_offload(offload, folder)

    def zeros(self, rows: int, cols: int) -> torch.Tensor:
        if not self.disk:  # (calloc'd: pages never written, the adjacency's rows of errors and tokens, stay unmapped)
            return torch.from_numpy(numpy.zeros((rows, cols), dtype=numpy.float32))
        where = str(self.folder) if self.folder is not None else None
        try:
            descriptor, name = tempfile.mkstemp(prefix="nncanon-graph-", suffix=".f32", dir=where)
        except OSError as error:
            raise CannotWrite(f"offload='disk': cannot create the rows' file in {where or tempfile.gettempdir()} "
                              f"({error.strerror}); give offload_dir= a writable folder, or set TMPDIR") from None
        size = rows * cols * 4
        try:
            try:
                if size and hasattr(os, "posix_fallocate"):  # (where the system has none: a sparse file, as before)
                    os.posix_fallocate(descriptor, 0, size)
            except OSError as error:
                raise GraphTooLarge(f"offload='disk': the rows' file needs {size / 2 ** 30:.2f} GiB in "
                                    f"{os.path.dirname(name)}, which cannot hold it ({error.strerror}); free space "
                                    "or give offload_dir= a folder on a larger disk") from None
            # (mapped before the name is removed: the mapping keeps the file's pages until the tensor is freed)
            return torch.from_file(name, shared=True, size=rows * cols, dtype=torch.float32).view(rows, cols)
        finally:
            os.close(descriptor)
            os.unlink(name)


def partial_influences(edges: torch.Tensor, logit_probs: torch.Tensor, row_node: torch.Tensor, total: int,
                       max_iter: int = 128) -> torch.Tensor:
    """Each node's influence on the logits through the rows computed so far (circuit-tracer's
    ``compute_partial_influences``): ``[total]``."""
    normalized = edges.abs()
    normalized = normalized / normalized.sum(dim=1, keepdim=True).clamp(min=1e-8)
    influence = torch.zeros(total)
    prod = torch.zeros(total)
    prod[-len(logit_probs):] = logit_probs.float()
    for _ in range(max_iter):
        prod = prod[row_node] @ normalized
        if not prod.any():
            break
        influence += prod
    return influence


def _decode(model: Any, ids: torch.Tensor) -> str:
    tokenizer = getattr(model, "tokenizer", None)
    return tokenizer.decode(ids[0]) if tokenizer is not None else ""
