"""`find_skeleton`: the model-level paths of an unknown architecture, read from a recorded forward.

The blocks are the ``ModuleList`` whose modules ran one after another, each taking the stream the
previous one returned; ``embed_tokens`` and ``lm_head`` are what ``get_input_embeddings`` and
``get_output_embeddings`` return; the final norm and any module before the head (OPT's
``project_out``) are the modules that ran after the last block and before the head.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import torch

from ..errors import UnknownFamilyError
from ..families.base import Embeddings
from .recording import Call, Recording

_TOWER = re.compile(r"vision|visual|audio|image|encoder")


@dataclass
class Skeleton:
    """The model-level paths (from the causal-LM root) and what was tried to find them."""

    layers: str
    embed_tokens: str
    lm_head: str
    norm: str | None
    before_head: tuple[str, ...]
    width: int
    tried: list[str] = field(default_factory=list)
    embeddings: Embeddings = Embeddings()


def path_of(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    """The path of ``module`` inside ``model`` (``None`` where it is not one of its modules)."""
    if module is None:
        return None
    return next((name for name, candidate in model.named_modules() if candidate is module), None)


def is_norm(module: torch.nn.Module, call: Call | None = None) -> bool:
    """A norm: no parameter of more than one axis, and (where it ran) an output of its input's shape."""
    if any(p.dim() > 1 for p in module.parameters()):
        return False
    if call is not None and call.input is not None and call.output is not None:
        return call.input.shape == call.output.shape
    return True


def has_matrix(module: torch.nn.Module) -> bool:
    """Whether a module holds a weight matrix (a projection, an MLP, an attention)."""
    return any(p.dim() > 1 for p in module.parameters())


def find_blocks(model: torch.nn.Module, run: Recording) -> tuple[str, list[str]]:
    """The path of the block list, and one line per ``ModuleList`` tried.

    Raises:
        UnknownFamilyError: no ``ModuleList`` of modules that ran in sequence, each on the stream the
            previous one returned (the message lists every candidate and why it was refused).
    """
    tried, found = [], []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or not len(module):
            continue
        if _TOWER.search(name):
            tried.append(f"{name}: inside a vision/audio tower")
            continue
        calls = [run.calls.get(f"{name}.{i}") for i in range(len(module))]
        if any(call is None for call in calls):
            tried.append(f"{name}: {sum(c is None for c in calls)} of its {len(calls)} modules did not run")
            continue
        if all(not has_matrix(m) or isinstance(m, torch.nn.Linear) for m in module):
            tried.append(f"{name}: its modules are single projections or hold no weight, not blocks")
            continue
        if any(a.end > b.start for a, b in itertools.pairwise(calls)):
            tried.append(f"{name}: its modules did not run one after another")
            continue
        streams = [c.input is not None and c.output is not None and c.input.dim() == 3 for c in calls]
        if not all(streams) or len({c.input.shape for c in calls}) != 1:
            tried.append(f"{name}: its modules do not all take a [batch, seq, hidden] stream")
            continue
        chained = all(torch.equal(a.output, b.input) for a, b in itertools.pairwise(calls))
        if not chained:
            tried.append(f"{name}: a module does not take the stream the previous one returned")
            continue
        found.append(name)
    if not found:
        lines = "; ".join(tried) or "the model has no ModuleList"
        raise UnknownFamilyError(
            f"nncanon found no list of blocks in {type(model).__name__}: it looked for a ModuleList whose "
            f"modules run one after another on the residual stream, in a forward of a twin of this config. "
            f"Tried: {lines}. Describe the model in a Family (nncanon/families/, docs/adding-a-family.md) "
            f"and pass it as StandardizedTransformer(..., family=...)."
        )
    best = max(found, key=lambda name: len(model.get_submodule(name)))
    return best, tried


def find_skeleton(model: torch.nn.Module, run: Recording) -> Skeleton:
    """The blocks, embedding, head, final norm and modules before the head of ``model``."""
    layers, tried = find_blocks(model, run)
    blocks = model.get_submodule(layers)
    width = run.calls[f"{layers}.0"].input.shape[-1]
    embed = path_of(model, model.get_input_embeddings())
    head = path_of(model, model.get_output_embeddings())
    if head is None:
        vocab = run.logits.shape[-1]
        outside = [c for c in run.calls.values() if not c.name.startswith(f"{layers}.") and c.output is not None
                   and c.output.shape[-1] >= vocab and isinstance(run.modules[c.name], torch.nn.Linear)]
        head = outside[-1].name if outside else None
        tried.append("lm_head: get_output_embeddings() returned nothing; took the last Linear to the vocabulary")
    if embed is None or head is None:
        missing = "get_input_embeddings()" if embed is None else "get_output_embeddings() or a Linear to the vocabulary"
        raise UnknownFamilyError(
            f"nncanon could not infer a family for {type(model).__name__}: {missing} gave no module of the model"
        )
    last = run.calls[f"{layers}.{len(blocks) - 1}"]
    head_call = run.calls[head]
    window = [c for c in run.calls.values() if c.start > last.end and c.end < head_call.start]
    top = [c for c in window if not any(c.name.startswith(f"{o.name}.") for o in window)]
    top.sort(key=lambda c: c.start)
    norm = None
    if top and is_norm(run.modules[top[0].name], top[0]):
        norm = top.pop(0).name
    first = run.calls[f"{layers}.0"]
    entering = [c for c in run.calls.values() if c.end < first.start and c.name != embed
                and not c.name.startswith(f"{embed}.")]
    entering = [c for c in entering if not any(c.name.startswith(f"{o.name}.") for o in entering)]
    return Skeleton(layers, embed, head, norm, tuple(c.name for c in top), width, tried,
                    _embeddings(model, run, entering))


def _embeddings(model: torch.nn.Module, run: Recording, entering: list[Call]) -> Embeddings:
    """How the embeddings enter block 0, from the modules that ran between the token embedding and it: an
    ``nn.Embedding`` there is the position embedding, a norm with weights the embedding norm (the proof checks the
    formula). Without one, why there is none: a rotary embedding where the model has one, else what was seen."""
    entering.sort(key=lambda c: c.start)
    positions = next((c.name for c in entering if isinstance(run.modules[c.name], torch.nn.Embedding)
                      or "Positional" in type(run.modules[c.name]).__name__), None)
    norm = next((c.name for c in entering if c.name != positions and any(True for _ in run.modules[c.name].parameters())
                 and is_norm(run.modules[c.name], c)), None)
    rotary = any(re.search("rotary|rope", type(m).__name__, re.IGNORECASE) for m in model.modules())
    kind = "rotary" if rotary or positions is not None else (
        "inferred: no position embedding module runs before the first block, and the model has no rotary embedding "
        "module (its positions, if any, enter inside the blocks)")
    return Embeddings(positions=positions, positions_kind=kind, norm=norm)
