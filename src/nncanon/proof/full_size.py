"""What a twin proved holds on the model it stands for: the checks run on a full-size model of a real config.

The load-time proof runs on a twin (`nncanon.proof.ladder`); this builds the model of the config itself, at its
full size, with random weights (perturbed as a twin's are, so no bias or gain sits at an exact zero or one),
and runs the same verifier on it (`nncanon.proof.verdict.verify`: every value against plain PyTorch hooks, the
contribution identity, ablations, invokes, gradients...). ``benchmarks/full_size.py`` runs it on every
checkpoint of the corpus of at most ~500M parameters; the suite runs one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..families import family_for
from ..mounted import MountedModel
from .prompts import tiny_tokenizer
from .twin import model_class_for, parameter_count, perturb
from .verdict import Verdict, verify


@dataclass
class FullSizeRun:
    """The verdict of the checks on a full-size model, its size and how long building and checking took."""

    verdict: Verdict
    parameters: int
    build_seconds: float
    check_seconds: float


def full_size_model(config: Any, seed: int = 0, attn_implementation: str = "eager") -> MountedModel:
    """The registered family's surface mounted on the causal LM of ``config`` at its full size: random weights
    from ``seed`` (then perturbed), fp32, eval mode, on the CPU, with the proof's tokenizer. Nothing is proved:
    `verify` it."""
    cls = model_class_for(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = cls._from_config(config, attn_implementation=attn_implementation).float().eval()
        perturb(module)
    return MountedModel(module, family=family_for(config), tokenizer=tiny_tokenizer())


def verify_full_size(config: Any, seed: int = 0, attn_implementation: str = "eager") -> FullSizeRun:
    """Build `full_size_model` of ``config`` and run every check on it, on one torch thread as the load-time
    proof runs: the bit-for-bit checks compare two forwards, which agree bit for bit only where the kernels
    sum in the same order both times (a multi-threaded BLAS on a busy machine can pick another thread count
    for the second, and round differently)."""
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = full_size_model(config, seed, attn_implementation)
        built = time.perf_counter()
        verdict = verify(model)
    finally:
        torch.set_num_threads(threads)
    return FullSizeRun(verdict, parameter_count(model._module), round(built - start, 2),
                       round(time.perf_counter() - built, 2))
