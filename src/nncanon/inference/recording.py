"""`record_run`: one forward of a twin with a hook on every module, kept as data.

The inference reads the model's structure from what ran, not from names: which modules ran in
which order, what each took and returned (``[b, s, d]`` tensors cloned at the hook), which module
was running when a softmax over ``[b, H, q, k]`` (or ``[b·H, q, q]``) scores ran, and which outputs the model changed in
place after their module returned (Falcon adds attention into the MLP output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from nnsight.intervention.util import first_input
from torch.overrides import TorchFunctionMode

from ..proof.prompts import PROMPTS, tiny_tokenizer

_SOFTMAX = {
    torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax, torch.nn.functional.scaled_dot_product_attention,
}


@dataclass
class Call:
    """One call of one module during the recorded forward.

    Attributes:
        name: The module's path from the model root.
        start: Its position in the order of calls (when it was entered).
        end: The position when it returned (calls inside it lie between ``start`` and ``end``).
        input: Its first input, cloned (``None`` where it is not a tensor).
        output: Its output's tensor (the first element of a tuple), cloned.
        tuple_length: The length of the output tuple (``None``: a tensor).
        changed_later: The model changed the output tensor in place after the module returned.
        items: Shape and whether floating, of each tensor element of a tuple output (routers).
    """

    name: str
    start: int
    end: int = -1
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    tuple_length: int | None = None
    changed_later: bool = False
    items: tuple[tuple[tuple[int, ...], bool], ...] = ()


@dataclass
class Recording:
    """The recorded forward: every call (first call of each module), the softmax sites and the logits."""

    calls: dict[str, Call]
    softmax_in: list[str]
    logits: torch.Tensor
    input_ids: torch.Tensor
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)

    def ran(self, name: str) -> bool:
        return name in self.calls

    def within(self, parent: str) -> list[Call]:
        """The calls of modules strictly below ``parent`` (by path), in call order."""
        prefix = f"{parent}." if parent else ""
        return sorted((c for n, c in self.calls.items() if n.startswith(prefix) and n != parent),
                      key=lambda c: c.start)


class _SoftmaxWatch(TorchFunctionMode):
    def __init__(self, stack: list[str], seen: list[str]) -> None:
        super().__init__()
        self.stack, self.seen = stack, seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        scores = args[0] if args and isinstance(args[0], torch.Tensor) else None
        square = scores is not None and scores.dim() == 3 and scores.shape[-1] == scores.shape[-2]  # (b·H, q, k)
        if func in _SOFTMAX and scores is not None and (scores.dim() == 4 or square):
            self.seen.append(self.stack[-1] if self.stack else "")
        return func(*args, **kwargs)


def _tensor(value: Any) -> tuple[torch.Tensor | None, int | None]:
    if isinstance(value, torch.Tensor):
        return value, None
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0], len(value)
    if hasattr(value, "last_hidden_state") and not isinstance(value, torch.Tensor):
        return value[0], None
    return None, None


def record_run(model: torch.nn.Module, prompt: str = PROMPTS[0]) -> Recording:
    """Run ``model`` (a twin: fp32, CPU, eager attention) once on ``prompt`` and record every call."""
    names = {id(module): name for name, module in model.named_modules()}
    modules = dict(model.named_modules())
    calls: dict[str, Call] = {}
    raw: dict[str, torch.Tensor] = {}
    stack: list[str] = []
    seen: list[str] = []
    counter = [0]

    def pre(module, args, kwargs):
        name = names.get(id(module))
        if name is None:
            return
        stack.append(name)
        counter[0] += 1
        if name not in calls:
            value = first_input(args, kwargs) if (args or kwargs) else None
            kept = value.detach().clone() if isinstance(value, torch.Tensor) else None
            calls[name] = Call(name, counter[0], input=kept)

    def post(module, args, kwargs, output):
        name = names.get(id(module))
        if name is None:
            return
        if stack and stack[-1] == name:
            stack.pop()
        counter[0] += 1
        call = calls[name]
        if call.end < 0:
            call.end = counter[0]
            tensor, length = _tensor(output)
            if tensor is not None:
                call.output, call.tuple_length = tensor.detach().clone(), length
                raw[name] = tensor
            if isinstance(output, (tuple, list)):
                call.items = tuple((tuple(t.shape), t.is_floating_point()) if isinstance(t, torch.Tensor)
                                   else ((), False) for t in output)

    tokenizer = tiny_tokenizer()
    inputs = tokenizer(prompt, return_tensors="pt")
    handles = []
    for module in modules.values():
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad(), _SoftmaxWatch(stack, seen):
            output = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    finally:
        for handle in handles:
            handle.remove()
    for name, tensor in raw.items():
        call = calls[name]
        if call.output is not None and tensor.shape == call.output.shape and not torch.equal(tensor, call.output):
            call.changed_later = True
    logits = output.logits if hasattr(output, "logits") else output[0]
    return Recording(calls, seen, logits.detach(), inputs["input_ids"], modules)
