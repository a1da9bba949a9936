"""What the attention kernel receives, and the probabilities recomputed from it under any kernel.

The kernel is one call in an attention module's forward that receives the per-head queries, keys and
values (`Kernel`). In transformers 5 it is usually ``attention_interface(self, query, key, value, mask,
scaling=..., dropout=..., softcap=..., sliding_window=..., s_aux=...)`` with ``[b, heads, s, head_dim]``
tensors, after rotary and the cache; the implementation (eager, sdpa, flash...) is chosen by the
config. Families whose attention is written inline name their own call instead (`Family.kernel`):
Falcon's ``torch.nn.functional.scaled_dot_product_attention`` under sdpa (before transformers 5.25),
the ``self._attn(query, key, value, mask)`` of GPT-Neo, GPT-NeoX-Japanese and GPT-1, the score and
product calls of BLOOM, MPT and XGLM (`split_kernel`). nncanon serves those inputs per head
(``query_states``, ``key_states``, ``value_states``, read at the call by nnsight's ``.source``), and under
a kernel that computes no probabilities (sdpa) recomputes ``attention_probabilities`` from the same call:
with the family's own ``eager_attention_forward`` for the interface (so the mask, scaling, softcap, sinks
and ALiBi are applied as the model's eager code applies them), by sdpa's own definition
(``softmax(q·kᵀ·scale + mask)``) for a direct sdpa call. The load-time proof checks, per config, that
they equal eager's probabilities and multiply the values to the kernel's own output; where they do not,
they are declined.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
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


def _interface_scale(module: torch.nn.Module, kwargs: dict, head_dim: int) -> float:
    scale = kwargs.get("scaling")
    return head_dim**-0.5 if scale is None else scale


def unscaled(module: torch.nn.Module, kwargs: dict, head_dim: int) -> float:
    """1: a kernel that does not scale ``q·kᵀ`` (GPT-Neo), or whose query is scaled before it (XGLM)."""
    return 1.0


def _sdpa_scale(module: torch.nn.Module, kwargs: dict, head_dim: int) -> float:
    scale = kwargs.get("scale")
    return head_dim**-0.5 if scale is None else scale


@dataclass(frozen=True)
class Kernel:
    """The call of an attention forward that receives the per-head queries, keys and values.

    Attributes:
        op: Its operation name in the forward (nnsight's ``.source``), or a pattern ending in ``*`` (the
            last operation whose name starts with the rest, `nncanon.served.operation_name`).
        args: The positions of the query, key and value among the call's positional arguments (or the
            keywords they are passed by), each ``[b, heads, s, head_dim]`` (keys and values: key/value heads).
        mask: The position of the mask argument, ``None`` where the call takes none by position.
        mask_keyword: The keyword the mask may be passed by instead of its position.
        causal: The keyword saying the call applies a causal mask itself (sdpa's ``is_causal``), else ``None``.
        output: The element of the call's output holding the attention output (``None``: the output is it).
        output_heads_first: That output is ``[b, heads, s, head_dim]`` (else ``[b, s, heads, head_dim]``).
        key_transposed: The key is passed ``[b, heads, head_dim, s]`` (GPT-1 transposes it before the call).
        structural_mask: The call masks positions itself, from buffers no argument holds (GPT-Neo's local
            window, GPT-1's causal buffer): the ``kernel`` check takes the masked positions from the
            probabilities (where they are exactly zero) and proves the rest.
        recompute: How probabilities are recomputed under a kernel that computes none: ``"interface"``
            (the family's ``eager_attention_forward``), ``"sdpa"`` (sdpa's definition); ``None``: never
            (the call runs under eager only, where the probabilities are the model's own).
        implementations: The attention implementations under which the forward makes this call
            (``None``: every one).
        scale: ``(module, call keywords, head_dim) -> the factor on q·kᵀ``.
        name: The call, for messages.
        value_op: The call that takes the values (the probabilities' product with them), where the scores and
            the product are two calls (``torch.bmm(q, kᵀ)`` then ``torch.bmm(p, v)``); ``args[2]`` is the values'
            position there.
        batch_heads: The inputs fold the heads into the batch, ``[b·heads, s, head_dim]`` (BLOOM, XGLM).
        bias: The attention module's forward argument holding an additive position bias (ALiBi) the kernel
            adds to the scaled scores (BLOOM's ``alibi``, times the call's ``beta``; MPT's ``position_bias``):
            ``[b·heads, 1, k]`` or ``[heads, 1, k]``, its last ``k`` positions taken.
    """

    op: str
    args: tuple[int | str, int | str, int | str]
    mask: int | None
    mask_keyword: str | None = None
    causal: str | None = None
    output: int | None = 0
    output_heads_first: bool = False
    key_transposed: bool = False
    structural_mask: bool = False
    recompute: str | None = None
    implementations: tuple[str, ...] | None = None
    scale: Callable[[torch.nn.Module, dict, int], float] = _interface_scale
    name: str = "transformers' attention interface"
    value_op: str | None = None
    batch_heads: bool = False
    bias: str | None = None

    def inputs(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(query, key, value)`` of a call's arguments, ``[b, heads, s, head_dim]`` each (the key transposed
        back where the call takes it transposed; the value ``None`` where another call takes it, `value_op`)."""
        def pick(at: int | str) -> torch.Tensor:
            return kwargs[at] if isinstance(at, str) else args[at]

        key = pick(self.args[1])
        key = key.transpose(-1, -2) if self.key_transposed else key
        return pick(self.args[0]), key, None if self.value_op is not None else pick(self.args[2])

    def call_mask(self, args: tuple, kwargs: dict) -> Any:
        """The mask argument of a call (``None`` where it has none)."""
        if self.mask is not None and len(args) > self.mask:
            return args[self.mask]
        return kwargs.get(self.mask_keyword) if self.mask_keyword is not None else None

    @property
    def output_op(self) -> str:
        """The call whose output is the attention output (the values' call, `value_op`, where there are two)."""
        return self.op if self.value_op is None else self.value_op

    def attention_output(self, output: Any, batch: int) -> torch.Tensor:
        """The attention output of the `output_op` call, ``[b, s, heads, head_dim]`` (``batch``: ``b``)."""
        tensor = output if self.output is None else output[self.output]
        if self.batch_heads:
            tensor = tensor.unflatten(0, (batch, -1))
        return tensor.transpose(1, 2) if self.output_heads_first else tensor

    def runs_under(self, implementation: str | None) -> bool:
        """Whether the forward makes this call under ``implementation``."""
        return self.implementations is None or implementation in self.implementations


#: transformers' attention interface: ``attention_interface(self, query, key, value, mask, scaling=...)``.
INTERFACE_KERNEL = Kernel("attention_interface_*", (1, 2, 3), mask=4, mask_keyword="attention_mask",
                          recompute="interface")


def sdpa_kernel(op: str) -> Kernel:
    """A direct call of ``torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=...,
    is_causal=..., scale=...)``, made by the forward under sdpa only (Falcon before transformers 5.25), as operation
    ``op``."""
    return Kernel(op, (0, 1, 2), mask=3, mask_keyword="attn_mask", causal="is_causal", output=None,
                  output_heads_first=True, recompute="sdpa", implementations=("sdpa",), scale=_sdpa_scale,
                  name="torch.nn.functional.scaled_dot_product_attention")


def method_kernel(scale: Callable[[torch.nn.Module, dict, int], float], key_transposed: bool = False) -> Kernel:
    """The module's own ``self._attn(query, key, value, attention_mask)`` (GPT-Neo, GPT-NeoX-Japanese,
    GPT-1): heads-first inputs, the ``(output, weights)`` it returns heads-first, a mask of its own."""
    return Kernel("self__attn_*", (0, 1, 2), mask=3, mask_keyword="attention_mask", output=0,
                  output_heads_first=True, key_transposed=key_transposed, structural_mask=True, scale=scale,
                  name="its self._attn(query, key, value, mask)")


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


def kernel_for(cls: type, declared: Kernel | str | None) -> Kernel | str:
    """The kernel call of attention class ``cls``, or why it has none: the family's ``declared`` kernel (or
    its reason for having none) where it names one, else transformers' attention interface where the
    forward calls it."""
    if declared is not None:
        return declared
    reason = interface_reason(cls)
    return INTERFACE_KERNEL if reason is None else reason


def kernel_reason(kernel: Kernel | str, implementation: str | None) -> str | None:
    """Why the kernel's inputs are not read under ``implementation`` (``None``: they are)."""
    if isinstance(kernel, str):
        return kernel
    if kernel.runs_under(implementation):
        return None
    return (f"its attention computes attention inline under attn_implementation={implementation!r}: the kernel's "
            f"per-head inputs are read at its call of {kernel.name}, which it makes under "
            f"{', '.join(map(repr, kernel.implementations or ()))} only. Load the model with "
            f"StandardizedTransformer(..., attn_implementation={kernel.implementations[0]!r}) to read them.")


def _eager_function(cls: type) -> Callable | None:
    """The ``eager_attention_forward`` of ``cls``'s modeling module (``None`` where it has none)."""
    function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    return function if callable(function) else None


def implementation(module: torch.nn.Module) -> str | None:
    """The attention implementation ``module`` runs (its config's ``_attn_implementation``)."""
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def recompute_reason(cls: type, implementation: str | None, kernel: Kernel | str | None = None) -> str | None:
    """Why probabilities cannot be recomputed for ``cls`` under ``implementation`` (``None``: they can), from
    ``kernel`` (`kernel_for`: the class's kernel call, or why it has none; by default, found as `kernel_for`
    finds it with no family kernel)."""
    eager = "Load the model with StandardizedTransformer(..., attn_implementation=\"eager\") to read them."
    computed = f"attention probabilities are not computed under attn_implementation={implementation!r}"
    kernel = kernel_for(cls, kernel)
    if isinstance(kernel, str):
        return f"{computed}, and {kernel}. {eager}"
    if kernel.recompute is None:
        return f"{computed}, and its kernel ({kernel.name}) is not one they are recomputed from. {eager}"
    if implementation not in RECOMPUTABLE:
        return (f"{computed}, and they are recomputed (exactly, proved per config) only under "
                f"{', '.join(map(repr, RECOMPUTABLE))}, whose mask holds the causal, padding and sliding-window "
                f"structure. {eager}")
    if not kernel.runs_under(implementation):
        return f"{computed}, and {kernel_reason(kernel, implementation)}"
    if kernel.recompute == "interface" and _eager_function(cls) is None:
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


#: Why a write to the recomputed probabilities' gradient is refused (`nncanon.gradients.refuse_gradient_write`).
GRADIENT_WRITE_REASON = (
    "the probabilities are recomputed beside the kernel under attn_implementation={implementation!r}: their "
    "gradient is served, exactly, but the kernel computes the gradients of the query and key states itself, "
    "so a gradient written here would not reach them. Load the model with "
    "StandardizedTransformer(..., attn_implementation=\"eager\") to write it."
)


class _Beside(torch.autograd.Function):
    """``_Beside(probabilities, output)``: a copy of the recomputed ``probabilities`` that is in the graph
    (so that a tensor hook on it fires) and sends no gradient anywhere; ``output`` only anchors it."""

    @staticmethod
    def forward(ctx: Any, probabilities: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        return probabilities.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return None, None


class _KernelOutput(torch.autograd.Function):
    """``_KernelOutput(output, probabilities, value, heads_first)``: a copy of the kernel's ``output``
    ``[b, s, H, d]`` (``[b, H, s, d]`` where ``heads_first``), bit for bit, whose backward passes the gradient
    on to ``output`` unchanged and gives ``probabilities`` ``[b, H, q, k]`` the gradient of
    ``output = probabilities · value`` per head: ``dO · Vᵀ`` (``value`` ``[b, KV, k, d]``, key/value heads
    repeated for grouped queries); nothing to ``value``."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, probabilities: torch.Tensor, value: torch.Tensor,
                heads_first: bool) -> torch.Tensor:
        ctx.save_for_backward(value)
        ctx.dtype, ctx.heads_first = probabilities.dtype, heads_first
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (value,) = ctx.saved_tensors
        per_head = grad if ctx.heads_first else grad.transpose(1, 2)
        heads = per_head.shape[1]
        if value.shape[1] != heads:
            value = value.repeat_interleave(heads // value.shape[1], dim=1)
        probabilities = torch.matmul(per_head.to(value.dtype), value.transpose(-1, -2))
        return grad, probabilities.to(ctx.dtype), None, None


def probabilities_in_graph(probabilities: torch.Tensor, output: torch.Tensor, value: torch.Tensor,
                           heads_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probabilities, output)`` put into the graph: the recomputed ``probabilities`` ``[b, H, q, k]``
    (computed without a graph) as a tensor whose ``.grad`` is the exact gradient of the model's loss at the
    probabilities, and the kernel call's ``output`` (``[b, s, H, d]``, ``[b, H, s, d]`` where
    ``heads_first``) to hand the model in place of its own (the same data, bit for bit; the same gradient
    reaches the kernel). ``value`` ``[b, KV, k, d]`` is the call's value states."""
    served = _Beside.apply(probabilities, output)
    return served, _KernelOutput.apply(output, served, value.detach(), heads_first)


def recompute_probabilities(module: torch.nn.Module, args: tuple, kwargs: dict,
                            kernel: Kernel | None = None) -> torch.Tensor:
    """The probabilities ``[b, heads, q, k]`` of one ``kernel`` call (default: transformers' attention
    interface), recomputed from the call's arguments: by the family's own ``eager_attention_forward`` for
    the interface, as ``softmax(q·kᵀ·scale + mask)`` (sdpa's definition) for a direct sdpa call.

    The values take no part (an empty value is passed, so the output costs nothing); dropout is off.

    Raises:
        ValueNotAvailable: the module's class or the implementation cannot be recomputed exactly (the
            reason), the mask is not a tensor mask, dropout is active (a training-mode module), or the call
            soft-caps the scores (which sdpa ignores).
    """
    cls = type(module)
    kernel = INTERFACE_KERNEL if kernel is None else kernel
    reason = recompute_reason(cls, implementation(module), kernel)
    if reason is not None:
        raise ValueNotAvailable(reason)
    query, key, value = kernel.inputs(args, kwargs)
    mask = kernel.call_mask(args, kwargs)
    dropout = kwargs.get("dropout", kwargs.get("dropout_p"))
    if float(dropout or 0.0) > 0.0 and module.training:
        raise ValueNotAvailable(
            "attention dropout is active (the module is in training mode): the probabilities the kernel "
            "sampled cannot be recomputed. Call model.eval(), or load with attn_implementation=\"eager\"."
        )
    if kwargs.get("softcap") is not None:
        raise ValueNotAvailable(
            f"this attention soft-caps its scores (softcap={kwargs['softcap']}), and the "
            f"{implementation(module)!r} kernel ignores the soft-cap (transformers before 5.21 let Gemma-2 and "
            f"VaultGemma run sdpa; later minors refuse it): eager's soft-capped probabilities are not the ones "
            f"the kernel used. Load the model with StandardizedTransformer(..., attn_implementation=\"eager\") "
            f"to read them."
        )
    if kernel.recompute == "sdpa":
        return _sdpa_probabilities(module, kernel, query, key, mask, kwargs)
    options = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "is_causal")}
    options["dropout"] = 0.0
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    additive = _additive_mask(mask, query, key, causal)
    _, probabilities = _eager_function(cls)(module, query, key, value[..., :0], additive, **options)
    return probabilities


def _sdpa_probabilities(module: torch.nn.Module, kernel: Kernel, query: torch.Tensor, key: torch.Tensor,
                        mask: Any, kwargs: dict) -> torch.Tensor:
    """``softmax(q·kᵀ·scale + mask)`` of a direct sdpa call, in fp32, cast to the query's dtype."""
    return torch.softmax(_sdpa_scores(module, kernel, query, key, mask, kwargs).float(), dim=-1).to(query.dtype)


def _sdpa_scores(module: torch.nn.Module, kernel: Kernel, query: torch.Tensor, key: torch.Tensor,
                 mask: Any, kwargs: dict) -> torch.Tensor:
    """``q·kᵀ·scale + mask`` of a direct sdpa call ``[b, heads, q, k]``: what its softmax receives."""
    if kwargs.get("enable_gqa") and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
    scores = (query @ key.transpose(-1, -2)) * kernel.scale(module, kwargs, query.shape[-1])
    additive = _additive_mask(mask, query, key, bool(kwargs.get(kernel.causal, False)))
    return scores if additive is None else scores + additive


class _SoftmaxInput(torch.overrides.TorchFunctionMode):
    """Keeps what the softmax of an ``eager_attention_forward`` receives (`recompute_both`): the input of its
    last softmax call, or, where a sink column is concatenated to the scores before it (gpt-oss), the scores
    before that concatenation (the first tensor of the last ``torch.cat`` before the softmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.scores: torch.Tensor | None = None
        self.before_sink: torch.Tensor | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "cat" and args and isinstance(args[0], (list, tuple)) and args[0]:
            self.before_sink = args[0][0]
        elif name == "softmax" and args:
            self.scores = args[0]
            sunk = self.before_sink
            if sunk is not None and sunk.shape[:-1] == self.scores.shape[:-1] and (
                    sunk.shape[-1] + 1 == self.scores.shape[-1]):
                self.scores = sunk
        return func(*args, **kwargs)


def recompute_both(module: torch.nn.Module, args: tuple, kwargs: dict, kernel: Kernel | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, probabilities)`` ``[b, heads, q, k]`` of one ``kernel`` call, recomputed from its arguments in
    one go: the probabilities as `recompute_probabilities` recomputes them, and the scores, what the softmax of the
    family's own ``eager_attention_forward`` receives there (scaled, soft-capped, masked; where a sink logit is
    concatenated before the softmax, the scores without it), or ``q·kᵀ·scale + mask`` for a direct sdpa call.

    Raises:
        ValueNotAvailable: as `recompute_probabilities` does, or the eager code calls no softmax.
    """
    kernel = INTERFACE_KERNEL if kernel is None else kernel
    if kernel.recompute == "sdpa":
        probabilities = recompute_probabilities(module, args, kwargs, kernel)  # (its refusals: the scores' too)
        query, key, _ = kernel.inputs(args, kwargs)
        return _sdpa_scores(module, kernel, query, key, kernel.call_mask(args, kwargs), kwargs), probabilities
    with _SoftmaxInput() as kept:
        probabilities = recompute_probabilities(module, args, kwargs, kernel)
    if kept.scores is None:
        raise ValueNotAvailable(
            f"{type(module).__module__}.eager_attention_forward calls no softmax: its scores cannot be recomputed. "
            "Load the model with StandardizedTransformer(..., attn_implementation=\"eager\") to read them.")
    return kept.scores, probabilities


def split_kernel(op: str, value_op: str, args: tuple[int | str, int | str, int | str],
                 scale: Callable[[torch.nn.Module, dict, int], float], name: str, batch_heads: bool = False,
                 bias: str | None = None) -> Kernel:
    """Attention written inline as two calls (BLOOM, MPT, XGLM): the scores ``op`` takes the query and the key
    transposed (``q @ kᵀ``), the product ``value_op`` takes the probabilities and the values and returns the
    attention output heads-first; the causal and padding masks are added between them (not arguments of
    either call), so the ``kernel`` check masks as the kernel masked."""
    return Kernel(op, args, mask=None, output=None, output_heads_first=True, key_transposed=True,
                  structural_mask=True, scale=scale, name=name, value_op=value_op, batch_heads=batch_heads,
                  bias=bias)


def scores_operation(source: Any, path: tuple[str, ...] | None, sinks: bool = False) -> tuple[Any, bool]:
    """The operation of an attention forward whose input holds its scores, under eager attention: the softmax
    call of the source that computes the probabilities (``source``: the attention module's nnsight ``.source``,
    inside a trace; ``path``: the family's path to the probabilities' operation, `Family.probabilities`, whose
    source is searched, else the attention interface call's), and ``True`` where the scores are the first tensor
    of the list a concatenation before that softmax receives (``sinks``: the module has sink logits, a column the
    eager code appends to the scores: gpt-oss).

    Raises:
        ValueNotAvailable: that source calls no softmax.
    """
    if path is not None:
        for name in path[:-1]:
            source = getattr(source, name).source
    else:
        calls = [name for name in source.names if name.startswith("attention_interface_")]
        source = getattr(source, calls[-1]).source
    names = list(source.names)
    softmaxes = [name for name in names if "softmax" in name]
    if not softmaxes:
        raise ValueNotAvailable("its eager attention calls no softmax whose input would be the scores")
    before = names[: names.index(softmaxes[-1])]
    concatenations = [name for name in before if name.startswith("torch_cat_")]
    if sinks and concatenations:
        return getattr(source, concatenations[-1]), True
    return getattr(source, softmaxes[-1]), False


def has_sinks(module: torch.nn.Module) -> bool:
    """Whether attention ``module`` has sink logits (``module.sinks``, one per head: gpt-oss)."""
    return isinstance(getattr(module, "sinks", None), torch.Tensor)
