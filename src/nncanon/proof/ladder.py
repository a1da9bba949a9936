"""The ladder of twins: the proof runs on the first twin of a config that runs in plain transformers.

A twin is built step by step, each step tried only when the one before it failed:

1. **the table's sizes** (`nncanon.proof.shrink.RULES`): every width, head count, expert count and window
   shrunk to the table's targets, the smallest twin (about 0.1-1M parameters);
2. **every width ÷ F, counts kept**, for F from the largest power of two that takes the stream to 64 wide
   (`widest_factor`: 64 for a 4096-wide model) down to 2, halving: every width of the table divided by one
   common factor, every count (heads, key/value heads, experts, experts per token, groups) as the config
   has it, so every proportion between sizes holds as in the config, named in the table or not;
3. **the config's widths and counts** (F = 1), windows still shrunk;
4. **the config's sizes**, windows included.

Every step keeps the fewest blocks that hold each kind of block and a vocabulary of 320 tokens. A step is
taken when its twin runs with plain transformers what the checks run: a forward of the proof's first prompt,
a left-padded batch of its prompts, and a two-token greedy ``generate`` with the model's cache (`plain_run`).
A step whose twin would have more than `MAX_PARAMETERS` parameters is skipped, and no step starts after
`SECONDS` of trying. Where only ``generate`` fails on every step, the first twin whose forwards ran is taken
(no check runs ``generate``), and the proof says so. Where no twin runs at all, `NoTwinRuns` carries
transformers' own error on the least-shrunk twin tried: the config is one transformers itself cannot run.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..quantization import Quantization
from .prompts import PROMPTS, tiny_tokenizer
from .shrink import TABLE, Shrink, TwinError, widest_factor
from .twin import Twin, TwinTooLarge, build_twin, model_class_for, quantized_twin

#: No step builds a twin of more parameters than this (400 MB of fp32 weights; the checks hold a few copies).
MAX_PARAMETERS = 100_000_000
#: No step starts after this many seconds of trying.
SECONDS = 60.0


def steps(config: Any) -> list[Shrink]:
    """The ladder of ``config``: the table's sizes, then every width ÷ F for F = `widest_factor` ... 2,
    the config's widths, the config's sizes."""
    ladder = [TABLE]
    factor = widest_factor(config)
    while factor > 1:
        ladder.append(Shrink(factor))
        factor //= 2
    return [*ladder, Shrink(1), Shrink(1, windows=False)]


@dataclass(frozen=True)
class Attempt:
    """A step not taken and why: ``outcome`` is transformers' error, or why the step was skipped."""

    step: int
    shrink: Shrink
    outcome: str

    def describe(self) -> str:
        return f"step {self.step} ({self.shrink.describe()}): {self.outcome}"


@dataclass
class TwinRun:
    """The twin a proof runs on, which step of the ladder it is (1-based), and the steps before it."""

    twin: Twin
    step: int
    attempts: list[Attempt] = field(default_factory=list)
    note: str = ""

    def describe(self) -> str:
        """``step 2 of the ladder (every width ÷ 32, counts kept): 128 wide, 16 heads of 8, 2 of 28 blocks, ...``."""
        sizes = self.twin.sizes()
        parts = [f"{sizes['width']} wide"] if sizes["width"] else []
        if sizes["heads"]:
            parts.append(f"{sizes['heads']} heads of {sizes['head_width']}" if sizes["head_width"] else
                         f"{sizes['heads']} heads")
        parts.append(f"{sizes['blocks']} of {sizes['of_blocks']} blocks")
        if sizes["vocabulary"]:
            parts.append(f"vocabulary {sizes['vocabulary']}")
        parts.append(f"{_millions(sizes['parameters'])} parameters")
        return f"step {self.step} of the ladder ({self.twin.shrink.describe()}): {', '.join(parts)}"

    def to_dict(self) -> dict:
        """As plain data (the proof cache)."""
        return {"step": self.step, "shrink": [self.twin.shrink.factor, self.twin.shrink.windows],
                "sizes": self.twin.sizes(), "described": self.describe(), "note": self.note,
                "before": [attempt.describe() for attempt in self.attempts]}


def _millions(count: int) -> str:
    return f"{count / 1e6:.1f}M" if count >= 100_000 else f"{count / 1e6:.2f}M"


class NoTwinRuns(TwinError):
    """No step of the ladder gave a twin that runs: transformers cannot run this config (the message has its
    error on the least-shrunk twin tried), or every twin that might is over the budget."""

    def __init__(self, message: str, attempts: list[Attempt]) -> None:
        super().__init__(message)
        self.attempts = attempts


def plain_run(model: torch.nn.Module, tokenizer: Any = None) -> tuple[Exception | None, Exception | None]:
    """Run ``model`` (a twin) as the checks do, with plain transformers: a forward of the proof's first prompt
    and a left-padded batch of its prompts, then a two-token greedy ``generate`` with the model's cache.

    Returns:
        ``(forward_error, generate_error)``: what each part raised, ``None`` where it ran.
    """
    tokenizer = tokenizer or tiny_tokenizer()
    one = tokenizer(PROMPTS[0], return_tensors="pt")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model(**one)
            model(**batch)
        except Exception as error:
            return error, None
        try:
            model.generate(**one, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        except Exception as error:
            return None, error
    return None, None


def _error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:400]


def running_twin(config: Any, model_class: type | None = None, blocks: str | None = None, seed: int = 0,
                 tokenizer: Any = None, quantization: Quantization | None = None) -> TwinRun:
    """The twin of ``config`` the proof runs on: the first step of the ladder (`steps`) whose twin runs
    (`plain_run`), within `MAX_PARAMETERS` and `SECONDS`. With ``quantization``, each step's twin is quantized (or
    cast) as the model is (`quantized_twin`) before it runs: a step whose quantized twin does not run (a width the
    method's kernel does not take) gives way to the next.

    Raises:
        NoTwinRuns: no step's twin runs; the message names transformers' error on the least-shrunk twin.
    """
    cls = model_class or model_class_for(config)
    config = _fits_the_prompts(config, tokenizer or tiny_tokenizer())
    start = time.perf_counter()
    attempts: list[Attempt] = []
    fallback: tuple[Twin, int, str] | None = None  # the first twin whose forwards ran (its generate did not)
    ladder = steps(config)
    for number, shrink in enumerate(ladder, start=1):
        if time.perf_counter() - start > SECONDS:
            attempts.append(Attempt(number, shrink, f"not tried: the ladder's {SECONDS:.0f} s were spent"))
            continue
        try:
            twin = build_twin(config, seed=seed, model_class=cls, blocks=blocks, shrink=shrink,
                              max_parameters=MAX_PARAMETERS)
        except TwinTooLarge as error:
            attempts.append(Attempt(number, shrink, f"not tried: {error}"))
            continue
        except TwinError as error:
            attempts.append(Attempt(number, shrink, str(error)))
            continue
        if quantization is not None:
            try:
                twin.model = quantized_twin(twin.model, quantization)
            except Exception as error:
                attempts.append(Attempt(number, shrink, f"it cannot be {quantization.provenance()[7:]}: "
                                                        f"{_error_text(error)}"))
                continue
        forward_error, generate_error = plain_run(twin.model, tokenizer)
        if forward_error is None and generate_error is None:
            return TwinRun(twin, number, attempts)
        if forward_error is not None:
            attempts.append(Attempt(number, shrink, f"its forward fails in transformers: {_error_text(forward_error)}"))
            continue
        note = f"its cached generation step fails in transformers: {_error_text(generate_error)}"
        attempts.append(Attempt(number, shrink, note))
        if fallback is None:
            fallback = (twin, number, note)
    if fallback is not None:
        twin, number, note = fallback
        return TwinRun(twin, number, [a for a in attempts if a.step < number],
                       f"no step's twin generates ({note}); no check generates, so this twin's forwards stand")
    raise NoTwinRuns(_no_twin_message(config, attempts), attempts)


def _fits_the_prompts(config: Any, tokenizer: Any) -> Any:
    """``config``, or a copy whose vocabulary holds the proof's tokenizer: a model with fewer tokens than the
    proof's prompts use (``vocab_size`` under 300) would fail on ids with no row in its embedding, which is not a
    property of its layout. The vocabulary's size changes no value the proof checks (the rows of the embedding and
    the head only)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab, needed = getattr(text, "vocab_size", None), len(tokenizer)
    if not isinstance(vocab, int) or vocab >= needed:
        return config
    grown = copy.deepcopy(config)
    target = grown.get_text_config() if hasattr(grown, "get_text_config") else grown
    target.vocab_size = needed
    return grown


def _no_twin_message(config: Any, attempts: list[Attempt]) -> str:
    """The one reason of a config no twin runs: transformers' error on the least-shrunk twin tried."""
    tried = [a for a in attempts if not a.outcome.startswith("not tried")]
    skipped = [a for a in attempts if a.outcome.startswith("not tried")]
    name = type(config).__name__
    if not tried:
        budget = skipped[0].outcome.removeprefix("not tried: ")
        return f"no twin of this {name} could be built within the budget ({budget})"
    last = tried[-1]
    same = all(a.outcome.split(": ", 1)[-1] == last.outcome.split(": ", 1)[-1] for a in tried)
    message = (f"no twin of this {name} runs: on the least-shrunk twin tried, step {last.step} of the ladder "
               f"({last.shrink.describe()}), {last.outcome}")
    if same and len(tried) > 1:
        message += f" (the same error on all {len(tried)} steps tried: transformers cannot run this config)"
    if skipped:
        message += f"; {len(skipped)} later step(s) not tried ({skipped[0].outcome.removeprefix('not tried: ')})"
    return message


def twin(config: Any, seed: int = 0, model_class: type | None = None) -> torch.nn.Module:
    """A random-weight, shrunk copy of the causal LM of ``config`` that runs: the twin the load-time proof
    runs on (`running_twin`).

    Example:
        >>> from transformers import LlamaConfig
        >>> small = nncanon.twin(LlamaConfig(attention_bias=True))   # 7B's layout, 0.1M parameters
        >>> small.config.hidden_size, small.config.attention_bias
        (64, True)
    """
    return running_twin(config, model_class=model_class, seed=seed).twin.model
