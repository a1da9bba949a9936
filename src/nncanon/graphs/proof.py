"""Which models a graph can be built on: `support`, the structure's reasons and, where the structure allows one,
the linearity proof on the model itself at first use (`nncanon.graphs.verify` on a graph of a short prompt over
random transcoders), remembered per model.

A block with a nonlinearity on the stream's path that is not a frozen value (a norm inside attention such as
DeepSeek's compressed-KV norm or BitNet's sub-norms, a clamp of the values, a gate on attention's output) makes the
frozen model non-affine in the graph's sources: the proof measures it and the model is declined with the numbers.
"""

from __future__ import annotations

import weakref
from typing import Any

from .replacement import support as structural

#: The proof's prompt, and the tolerance of its checks (relative to each row's scale).
PROMPT, RTOL = "The cat sat on the", 1e-4

_PROVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def support(model: Any) -> str | None:
    """Why no attribution graph of ``model`` can be built, or ``None`` (the structure allows it and the frozen
    replacement model of a short prompt was proved affine in its sources, every edge its source's removal)."""
    reason = structural(model)
    if reason is not None:
        return reason
    module = model._module
    if module not in _PROVED:
        _PROVED[module] = prove(model)
    return _PROVED[module]


def prove(model: Any) -> str | None:
    """The linearity proof on ``model`` (a graph over random transcoders of `PROMPT`): ``None`` where it holds, the
    reason with the numbers where not."""
    from .attribution import build
    from .verify import random_transcoders, verify

    transcoders = random_transcoders(model, n_features=8)
    try:
        graph = build(model, PROMPT, transcoders, max_n_logits=2, max_feature_nodes=8, zero_bos=False)
    except Exception as error:  # any failure of the frozen model declines it, with what it was
        return f"the frozen replacement model could not be run on it ({type(error).__name__}: {error})"
    check = verify(model, graph, transcoders, samples=3, rtol=RTOL)
    if check.ok:
        return None
    return (f"the frozen replacement model is not affine in the graph's sources on this model ({check}): a "
            "nonlinearity on the stream's path is not a frozen value (a norm inside attention, a clamp, a gate on "
            "a sublayer's output)")
