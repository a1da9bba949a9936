"""One trace at a time on one model: threads that share a model take turns.

nnsight keeps a model's run state (its interleaver: the workers of the trace, the batch, the counts)
on the model, and runs a trace's code in greenlets bound to the thread that started them. Two threads
tracing one model at once would share that state; nnsight then fails at random
(``parent cannot be on a different thread``) or, worse, hands a trace back with its saves unbound.
So every trace, ``generate`` and one-shot forward of a `StandardizedTransformer` runs under the
model's lock (`trace_lock`): from the moment the trace's code starts to the moment its saves are back.

The lock is re-entrant (a trace inside a trace, in one thread, is nnsight's own business) and is per
torch module: two models trace in parallel, two wrappers of one module take turns. A trace body that starts
another thread which traces the same model and waits for it would wait forever: run that second trace after the
first.
"""

from __future__ import annotations

import threading
import weakref
from types import CodeType
from typing import Any

from nnsight.intervention.tracer import InterleavingTracer


class ProcessLock:
    """A ``threading.Lock`` of this process. A remote request ships nncanon's functions by value with the
    module state they read; a lock belongs to one process, so it travels as a new lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exception: Any) -> None:
        self._lock.__exit__(*exception)

    def __reduce__(self) -> tuple:
        return (type(self), ())


class ProcessRegistry(weakref.WeakKeyDictionary):
    """A weak registry of this process's objects (a model's lock, its blocks' execution orders); like
    `ProcessLock`, it travels in a remote request as a new, empty one."""

    def __reduce__(self) -> tuple:
        return (type(self), ())


class ProcessCache(dict):
    """A cache of this process (a mounting's worked-out sites, keyed by module classes); it travels in a remote
    request as a new, empty one: its keys may be classes the server cannot import (a checkpoint's custom code)."""

    def __reduce__(self) -> tuple:
        return (type(self), ())


_LOCKS = ProcessRegistry()
_GUARD = ProcessLock()


def trace_lock(model: Any) -> threading.RLock:
    """The lock that serialises the traces of ``model``: one per torch module it wraps, so that two wrappers of one
    module (two `StandardizedTransformer` over one ``PreTrainedModel``) take turns too, their hooks being on the
    same modules."""
    key = model.__dict__.get("_module", model) if hasattr(model, "__dict__") else model
    with _GUARD:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = threading.RLock()
        return lock


#: Key, in the model's ``__dict__``, of what the running trace generates with (see `generation_cache`).
_GENERATING = "_nncanon_generation_cache"


def generation_cache(model: Any) -> bool | None:
    """Whether the trace running on ``model`` is a ``generate`` with a cache (``True``), one without
    (``use_cache=False``: ``False``), or not a generation (``None``)."""
    return model.__dict__.get(_GENERATING)


class SerialTracer(InterleavingTracer):
    """nnsight's tracer, running its block under the model's `trace_lock`, and noting on the model
    whether it is a generation with a cache (`generation_cache`) while it runs."""

    def execute(self, code: CodeType) -> None:
        model = self.envoy
        with trace_lock(model):
            previous = model.__dict__.get(_GENERATING)
            model.__dict__[_GENERATING] = self._generation_cache()
            try:
                super().execute(code)
            finally:
                model.__dict__[_GENERATING] = previous

    def _generation_cache(self) -> bool | None:
        if getattr(self.fn, "__name__", None) != "generate":
            return None
        use_cache = self.kwargs.get("use_cache")
        if use_cache is None:
            config = self.kwargs.get("generation_config") or getattr(self.envoy._module, "generation_config", None)
            use_cache = getattr(config, "use_cache", None)
        return use_cache is not False
