"""One trace at a time on one model: threads that share a model take turns.

nnsight keeps a model's run state (its interleaver: the workers of the trace, the batch, the counts)
on the model, and runs a trace's code in greenlets bound to the thread that started them. Two threads
tracing one model at once would share that state; nnsight then fails at random
(``parent cannot be on a different thread``) or, worse, hands a trace back with its saves unbound.
So every trace, ``generate`` and one-shot forward of a `StandardizedTransformer` runs under the
model's lock (`trace_lock`): from the moment the trace's code starts to the moment its saves are back.

The lock is re-entrant (a trace inside a trace, in one thread, is nnsight's own business) and is per
model: two models trace in parallel. A trace body that starts another thread which traces the same
model and waits for it would wait forever: run that second trace after the first.
"""

from __future__ import annotations

import threading
import weakref
from types import CodeType
from typing import Any

from nnsight.intervention.tracer import InterleavingTracer

_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()


def trace_lock(model: Any) -> threading.RLock:
    """The lock that serialises the traces of ``model``."""
    with _GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


class SerialTracer(InterleavingTracer):
    """nnsight's tracer, running its block under the model's `trace_lock`."""

    def execute(self, code: CodeType) -> None:
        with trace_lock(self.envoy):
            super().execute(code)
