"""Hyper-connected blocks (``k`` residual streams per position: `nncanon.families.Family.merged_streams`) on the frozen
replacement model.

Each block's hyper-connections (`nncanon.components.stream_gates`: the mix ``pre`` a sublayer reads, the weights
``post`` of its output in each stream, DeepSeek-V4's ``comb``) are frozen at the clean run's values at a step of
their own (`STREAMS` plus the child's name) before the sublayer they feed, and the final collapse of the streams
(``model.hc_head``, ``model.hyper_connection_mixer``) before the head; both read and written through
`nncanon.graphs.mixers`. The block is then linear in the streams: ``y = combᵀ·x + post ⊗ f(Σ pre·x)``.

A transcoder maps the MLP module's input ``u`` ``[b, s, d]`` to its output ``[b, s, d]`` (`WRITES_MODULE`:
``layers[i].mlp`` module's output, the name table's ``mlp_module_output``, TransformerLens ``mlp.hook_out``), not the
``[b, s, k·d]`` injection into the streams (``mlp_output``); so the frozen model writes the MLP module's output leaf
(clean module output less the transcoder's skip), and an error node is the module's output less the reconstruction,
``d`` wide like every node.

A model whose blocks take ``k`` streams stacked (Gemma-3n's AltUp: `nncanon.families.Family.rescale`) makes them from
the embeddings by ``k - 1`` projections, each rescaled to the embeddings' magnitude (a ratio of magnitudes computed
from the stream): the frozen model writes the stream entering block 0 as the token nodes' leaf stacked with its
projections rescaled by the clean run's magnitudes (`expand`), linear in the leaf; the collapse before the head is
frozen alike (`nncanon.graphs.head`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..components import stream_gates
from ..errors import ValueNotAvailable
from . import mixers

#: Prefixes the name of a block's hyper-connection where its frozen values are read or written back.
STREAMS = "<stream mix> "
#: The value a transcoder writes on a hyper-connected model: the MLP module's output (``d`` wide).
WRITES_MODULE = "mlp_module_output"


def hyper_connected(model: Any) -> bool:
    """Whether ``model``'s blocks keep several residual streams per position mixed by hyper-connections: its family
    keeps them on their own axis (`nncanon.families.Family.merged_streams`, served ``[b, s, k·d]``), or its first
    block calls a module `nncanon.components.stream_gates` names (Qwen4-Exp's, on a ``[b, s, k·d]`` stream)."""
    if model._family.merged_streams:
        return True
    return any(stream_gates.gates_of(child) for child in model.layers[0]._module.children())


def place(model: Any, layer: int, ordered: list[str], mlp_first: str) -> None:
    """Insert a `STREAMS` step in block ``layer``'s steps for each hyper-connection it calls: first (after the stream
    entering it) for the one feeding its token mixer, before ``mlp_first`` (the MLP side's first step: its norm's
    scale, or the transcoder's input) for the one feeding its MLP. Raise `ValueNotAvailable` where a hyper-connected
    block calls one that `nncanon.components.stream_gates` does not name."""
    block = model.layers[layer]
    calls = tuple(block.source.names)
    children = [(name, child) for name, child in block._module.named_children() if f"self_{name}_0" in calls]
    found = [(name, child) for name, child in children if stream_gates.gates_of(child)]
    if hyper_connected(model) and not found:
        raise ValueNotAvailable(
            f"layers[{layer}] keeps several streams per position, but none of its modules is a hyper-connection "
            "whose stream-computed weights nncanon freezes, so the block is not linear in the streams; those frozen "
            f"(nncanon.components.stream_gates): {'; '.join(f'{k}: {v}' for k, v in stream_gates.KINDS.items())}")
    mixer_at = min((calls.index(f"self_{name}_0") for name in (mixers.ATTENTION, mixers.MIXER)
                    if f"self_{name}_0" in calls), default=0)
    for name, _ in found:
        mixers.check(model, layer, name)
        _ = getattr(block, name).source.names  # (made outside a trace, as the attention's in `replacement`)
    mixer_side = [name for name, _ in found if calls.index(f"self_{name}_0") < mixer_at]
    for name, _ in reversed(found):
        if name not in mixer_side:
            ordered.insert(ordered.index(mlp_first), STREAMS + name)
    for name in reversed(mixer_side):
        ordered.insert(int(ordered[:1] == ["layer_input"]), STREAMS + name)


def collapse(model: Any) -> str | None:
    """The path of the module that collapses the streams before the head, where its weights are frozen (else
    ``None``; `ValueNotAvailable` where a hyper-connected model's collapse is not one
    `nncanon.components.stream_gates` names)."""
    if not hyper_connected(model):
        return None
    path = model._family.norm
    module = model._optional(path) if path else None
    if module is None or not stream_gates.gates_of(module._module):
        name = type(module._module).__name__ if module is not None else None
        raise ValueNotAvailable(f"its final collapse of the streams ({path}, {name}) is not one whose stream-computed "
                                "weights nncanon freezes (nncanon.components.stream_gates)")
    mixers.check(model, None, path)
    _ = module.source.names
    return path


def stacked(model: Any) -> bool:
    """Whether ``model`` makes its stacked streams from the embeddings rescaled by their magnitudes
    (`nncanon.families.Family.rescale`), frozen by `expand_magnitudes` and `expand`."""
    return model._family.rescale is not None


def expand_magnitudes(model: Any, embeddings: torch.Tensor) -> list[torch.Tensor]:
    """The clean run's magnitudes of the stacked streams' rescaling, from its token vectors ``[n, d]``: ``[1, n, 1]``
    each (the embeddings', then each projection's)."""
    with torch.no_grad():
        _, magnitudes = model._family.rescale(model._module, "expand", embeddings[None])
    return [magnitude.detach() for magnitude in magnitudes]


def expand(model: Any, embeddings: torch.Tensor, magnitudes: list[torch.Tensor]) -> None:
    """Write the stream entering block 0 as the leaf ``embeddings`` ``[B, n, d]`` stacked with its projections
    rescaled by the clean ``magnitudes`` (inside the frozen run's trace): linear in the leaf."""
    model.layers[0].layer_input = model._family.rescale(model._module, "expand", embeddings, magnitudes)[0]


def owner(step: str) -> str:
    """The block's hyper-connection whose values a `STREAMS` step reads."""
    return step[len(STREAMS):]
