"""What the attention kernel receives, and the probabilities recomputed from it under any kernel.

In transformers 5, an attention module calls ``attention_interface(self, query, key, value, mask,
scaling=..., dropout=..., softcap=..., sliding_window=..., s_aux=...)`` with ``[b, heads, s, head_dim]``
tensors, after rotary and the cache; the implementation (eager, sdpa, flash...) is chosen by the
config. nncanon serves those inputs per head (``query_states``, ``key_states``, ``value_states``,
read at the call by nnsight's ``.source``), and under a kernel that computes no probabilities (sdpa)
recomputes ``attention_probabilities`` from the same call with the family's own
``eager_attention_forward``, so the mask, scaling, softcap, sinks and ALiBi are applied as the model's
eager code applies them. The load-time proof checks, per config, that they equal eager's probabilities
and multiply the values to the kernel's own output; where they do not, they are declined.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ValueNotAvailable

#: The per-head inputs of the attention kernel, by their position in the interface call.
STATES = {"query_states": 1, "key_states": 2, "value_states": 3}
#: The proof's name for "the probabilities recomputed under sdpa" (not a surface value: the surface
#: value is ``attention_probabilities``, served this way where the model does not run eager attention).
RECOMPUTED = "recomputed_probabilities"
#: Implementations whose interface call gets the mask the recomputation understands (a boolean or
#: additive tensor, or ``None`` for causal) and applies the sliding window through it.
RECOMPUTABLE = ("sdpa",)


def interface_reason(cls: type) -> str | None:
    """Why ``cls`` (an attention module class) has no attention-interface call to read, or ``None``."""
    # (Plain functions, no functools.cache: a remote request ships this module by value, and a cache
    # wrapper would be pickled by reference to a module the server does not have.)
    forward = inspect.unwrap(cls.forward)
    code = getattr(forward, "__code__", None)
    if code is not None and "attention_interface" in code.co_varnames:
        return None
    return (
        f"its attention ({cls.__name__}) computes attention inline, not through transformers' attention "
        f"interface, so the kernel's per-head inputs are not exposed"
    )


def _eager_function(cls: type) -> Callable | None:
    """The ``eager_attention_forward`` of ``cls``'s modeling module (``None`` where it has none)."""
    function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    return function if callable(function) else None


def implementation(module: torch.nn.Module) -> str | None:
    """The attention implementation ``module`` runs (its config's ``_attn_implementation``)."""
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def recompute_reason(cls: type, implementation: str | None) -> str | None:
    """Why probabilities cannot be recomputed for ``cls`` under ``implementation`` (``None``: they can)."""
    eager = "Load the model with StandardizedTransformer(..., attn_implementation=\"eager\") to read them."
    computed = f"attention probabilities are not computed under attn_implementation={implementation!r}"
    inline = interface_reason(cls)
    if inline is not None:
        return f"{computed}, and {inline}. {eager}"
    if implementation not in RECOMPUTABLE:
        return (f"{computed}, and they are recomputed (exactly, proved per config) only under "
                f"{', '.join(map(repr, RECOMPUTABLE))}, whose mask holds the causal, padding and sliding-window "
                f"structure. {eager}")
    if _eager_function(cls) is None:
        return f"{computed}, and {cls.__module__} has no eager_attention_forward to recompute them with. {eager}"
    return None


def _additive_mask(mask: Any, query: torch.Tensor, key: torch.Tensor, causal: bool) -> torch.Tensor | None:
    """The interface's ``mask`` as the additive float mask eager attention adds to the scores.

    ``None`` means what sdpa makes of it: causal (top-left aligned) where the module is causal and
    there is more than one query, else no mask. A boolean mask is ``True`` where a query attends.
    """
    dtype = query.dtype
    low = torch.finfo(dtype).min
    if mask is None:
        if not (causal and query.shape[-2] > 1):
            return None
        rows = torch.arange(query.shape[-2], device=query.device)[:, None]
        attends = rows >= torch.arange(key.shape[-2], device=query.device)[None, :]
        return torch.zeros(attends.shape, dtype=dtype, device=query.device).masked_fill_(~attends, low)[None, None]
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueNotAvailable(
            f"the attention mask reached the kernel as {type(mask).__name__}"
            f"{'' if not isinstance(mask, torch.Tensor) else f' of {mask.dim()} dims'}, not the 4-d mask the "
            f"recomputation needs. Load the model with attn_implementation=\"eager\" to read the probabilities."
        )
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, low)
    return mask


def recompute_probabilities(module: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """The probabilities ``[b, heads, q, k]`` of one attention-interface call, recomputed by the family's
    own ``eager_attention_forward`` from the call's ``(module, query, key, value, mask)`` and keywords.

    The values take no part (an empty value is passed, so the output costs nothing); dropout is off.

    Raises:
        ValueNotAvailable: the module's class or the implementation cannot be recomputed exactly (the
            reason), the mask is not a tensor mask, dropout is active (a training-mode module), or the call
            soft-caps the scores (which sdpa ignores).
    """
    cls = type(module)
    reason = recompute_reason(cls, implementation(module))
    if reason is not None:
        raise ValueNotAvailable(reason)
    query, key, value = args[1], args[2], args[3]
    mask = args[4] if len(args) > 4 else kwargs.get("attention_mask")
    options = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "is_causal")}
    if float(options.get("dropout") or 0.0) > 0.0 and module.training:
        raise ValueNotAvailable(
            "attention dropout is active (the module is in training mode): the probabilities the kernel "
            "sampled cannot be recomputed. Call model.eval(), or load with attn_implementation=\"eager\"."
        )
    if options.get("softcap") is not None:
        raise ValueNotAvailable(
            f"this attention soft-caps its scores (softcap={options['softcap']}), and the "
            f"{implementation(module)!r} kernel ignores the soft-cap (transformers before 5.21 let Gemma-2 and "
            f"VaultGemma run sdpa; later minors refuse it): eager's soft-capped probabilities are not the ones "
            f"the kernel used. Load the model with StandardizedTransformer(..., attn_implementation=\"eager\") "
            f"to read them."
        )
    options["dropout"] = 0.0
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    additive = _additive_mask(mask, query, key, causal)
    _, probabilities = _eager_function(cls)(module, query, key, value[..., :0], additive, **options)
    return probabilities
