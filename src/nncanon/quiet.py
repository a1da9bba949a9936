"""Silence the notices nncanon's own work triggers, only while it runs: never the user's.

Three notices a user did not cause:

* transformers' kernel fallback notice (``causal_conv1d_fn is falling back to its reference PyTorch
  implementation``...) when nncanon runs a forward on the CPU: the load-time proof on a twin, the
  CLI's studies. A forward the user runs still shows it (it is about their run).
* transformers' notice that a class cannot switch its attention implementation (``FalconForCausalLM does
  not support setting its attention implementation dynamically``), when the load-time proof makes a copy of
  the twin under another implementation to prove what the forward computes only there (Falcon's sdpa call,
  before transformers 5.25).
* nnsight's warning that RWKV's attention has a submodule named ``output`` (nnsight renames it
  ``E_output``), printed for every block when nncanon wraps the model. nncanon reads that module
  by its path, so the rename changes nothing for the user.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

#: The transformers logger of the kernel fallback notice, and the notice's words.
KERNEL_LOGGER = "transformers.integrations.hub_kernels"
KERNEL_NOTICE = "is falling back to its reference PyTorch implementation"
#: The transformers logger of the notice that a class cannot switch its attention implementation, and its words.
SWITCH_LOGGER = "transformers.modeling_utils"
SWITCH_NOTICE = "does not support setting its attention implementation dynamically"
#: The bitsandbytes logger whose int8 matmul logs "inputs will be cast ... to float16" at every call.
BNB_LOGGER = "bitsandbytes.autograd._functions"
#: nnsight's warning for a submodule named like an Envoy attribute (RWKV's ``attention.output``).
SUBMODULE_WARNING = r"Module '.*' has a submodule named '.*', which nnsight already serves on every module"


class _NoticeFilter(logging.Filter):
    def __init__(self, notice: str) -> None:
        super().__init__()
        self.notice = notice
        self.dropped = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.notice in record.getMessage():
            self.dropped = True
            return False
        return True


class _BelowError(logging.Filter):
    """Drops records below ERROR (one per block: a nested block's exit removes its own only)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextmanager
def kernel_notices_filtered() -> Iterator[None]:
    """Drop transformers' kernel fallback notices, its notices that a class cannot switch its attention
    implementation, and bitsandbytes' warnings (a quantized twin's), logged inside the block.

    transformers logs each fallback notice once per process (``warning_once``); one dropped here is
    forgotten on exit, so the user's own forward still shows it.
    """
    logger, switches = logging.getLogger(KERNEL_LOGGER), logging.getLogger(SWITCH_LOGGER)
    notices, switch_notices = _NoticeFilter(KERNEL_NOTICE), _NoticeFilter(SWITCH_NOTICE)
    logger.addFilter(notices)
    switches.addFilter(switch_notices)
    casts = logging.getLogger(BNB_LOGGER)  # (a quantized twin's int8 layers log a cast at every call)
    below_error = _BelowError()  # (a filter, not setLevel: that clears every logger's cache, 0.05 ms a load)
    casts.addFilter(below_error)
    try:
        yield
    finally:
        logger.removeFilter(notices)
        switches.removeFilter(switch_notices)
        casts.removeFilter(below_error)
        if notices.dropped:
            from transformers.utils import logging as transformers_logging

            transformers_logging.warning_once.cache_clear()


@contextmanager
def wrapping_quietly() -> Iterator[None]:
    """Ignore nnsight's renamed-submodule warning while nncanon wraps a model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SUBMODULE_WARNING, category=UserWarning)
        yield


@contextmanager
def progress_bars_hidden(hide: bool = True) -> Iterator[None]:
    """Hide transformers' progress bars ("Loading weights") inside the block, where ``hide``. Imports nothing heavy:
    before transformers is imported, huggingface_hub's switch is turned off (transformers reads it when imported),
    so the command line's usage errors, even under ``--quiet``, import neither torch nor transformers."""
    if not hide:
        yield
        return
    if "transformers" not in sys.modules:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        if are_progress_bars_disabled():
            yield
            return
        disable_progress_bars()
        try:
            yield
        finally:
            enable_progress_bars()
            if "transformers" in sys.modules:  # (imported inside the block: it read the switch off)
                sys.modules["transformers"].utils.logging.enable_progress_bar()
        return
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    if shown:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()
