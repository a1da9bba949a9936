"""Skips and resuming.

- ``skip``: skipped blocks pass the stream; the lens of the stream entering them equals the logits.
- ``resume``: a forward resumed at a layer with the recorded stream is the forward, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from ...resuming import next_token_only, resume_at, streams_entering
from ..prompts import PROMPTS
from .base import TOLERANCE, CheckResult, compare, guarded


def check_skip(model: Any) -> list[CheckResult]:
    """Every block skipped: the stream leaves as it entered, and the logits are its lens."""

    def run() -> list[CheckResult]:
        last = model.num_layers - 1
        with torch.no_grad(), model.trace(PROMPTS[0]):
            entering = model.layers[0].layer_input.save()
            model.skip_layers(0, last)
            leaving = model.layers[last].layer_output.save()
            lens = model.project_on_vocab(entering).save()
            logits = model.logits.save()
        passed = compare("skip", None, ("skip_layers",), leaving, entering, 0.0, "the stream through the skip")
        if not passed.passed:
            return [passed]
        return [compare("skip", None, ("skip_layers",), logits, lens, 0.0, "logits after the skip vs the lens")]

    return guarded("skip", None, ("skip_layers",), run)


def check_resume(model: Any) -> list[CheckResult]:
    """A forward resumed at layer 0 and at the middle layer with the recorded stream gives the forward's
    logits bit for bit; last-position-only logits equal the last row."""

    if "resume" in model._model_declines:  # the family says why a resumed forward is not the forward
        return []

    def run() -> list[CheckResult]:
        middle = model.num_layers // 2 or 1 if model.num_layers > 1 else 0
        streams = streams_entering(model, PROMPTS[0], [0, middle])
        with torch.no_grad(), model.trace(PROMPTS[0]):
            whole = model.logits.save()
        results = []
        for layer, stream in streams.items():
            with torch.no_grad(), model.trace(PROMPTS[0]):
                resume_at(model, layer, stream)
                resumed = model.logits.save()
            results.append(compare("resume", None, ("resume",), resumed, whole, 0.0, f"resumed at layers[{layer}]"))
        with torch.no_grad(), model.trace(PROMPTS[0], **next_token_only(model)):
            last = model.logits.save()
        results.append(compare("resume", None, ("resume",), last[:, -1], whole[:, -1], TOLERANCE,
                                "last-position logits only"))
        return results

    return guarded("resume", None, ("resume",), run)
