"""nnterp 1.3's ``nnterp.prompt_utils``: prompts with target tokens, and running them in batches.

`Prompt.from_strings` keeps, for each target word, the first token of ``"word"`` and of ``" word"``;
`run_prompts` returns, per target, the summed probability of its tokens: ``[num_prompts, num_layers]``
(one "layer" for plain next-token prediction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .nnsight_utils import compute_next_token_probs


class TokenizationError(Exception):
    """The tokenizer does not separate a word from its leading space."""


def _tokenizer_of(llm_or_tokenizer: Any) -> Any:
    prefix_free = getattr(type(llm_or_tokenizer), "add_prefix_false_tokenizer", None)
    if prefix_free is not None:
        return llm_or_tokenizer.add_prefix_false_tokenizer
    return getattr(llm_or_tokenizer, "tokenizer", llm_or_tokenizer)


def _first_token_hacky(tokenizer: Any, word: str) -> int | None:
    """The first token of ``word`` read after a "🍐" prefix (no leading space can be added)."""
    pear = tokenizer("🍐", add_special_tokens=False).input_ids
    tokens = tokenizer("🍐" + word, add_special_tokens=False).input_ids
    if tokens[: len(pear)] != pear:
        raise TokenizationError(f"the tokenizer merges '🍐' with {word!r}; cannot isolate the word's first token")
    return tokens[len(pear)] if len(tokens) > len(pear) else None


def get_first_tokens(words: str | list[str], llm_or_tokenizer: Any, use_hacky_implementation: bool = False
                     ) -> list[int]:
    """The first tokens of ``"word"`` and ``" word"`` for each word, without repeats.

    Args:
        words: One word or several.
        llm_or_tokenizer: A model (its ``add_prefix_false_tokenizer`` or ``tokenizer``) or a tokenizer.
        use_hacky_implementation: Find the first token of ``"word"`` after a "🍐" prefix.
    """
    words = [words] if isinstance(words, str) else words
    tokenizer = _tokenizer_of(llm_or_tokenizer)
    space = tokenizer(" ", add_special_tokens=False).input_ids
    space_token = space[0] if space else None
    found: list[int] = []
    for word in words:
        if use_hacky_implementation:
            token = _first_token_hacky(tokenizer, word)
            if token is not None:
                found.append(token)
            continue
        token = tokenizer(word, add_special_tokens=False).input_ids[0]
        spaced = tokenizer(" " + word, add_special_tokens=False).input_ids[0]
        if token == spaced:
            hacky = _first_token_hacky(tokenizer, word)
            token = hacky if hacky is not None else token
        found.append(token)
        if spaced != space_token:
            found.append(spaced)
    return list(dict.fromkeys(found))


@dataclass
class Prompt:
    """A prompt and the target tokens whose next-token probability to track.

    Args:
        prompt: The prompt.
        target_tokens: For each target name, its token ids.
        target_strings: For each target name, the words it came from.
    """

    prompt: str
    target_tokens: dict[str, list[int]]
    target_strings: dict[str, str | list[str]] | None = None

    @classmethod
    def from_strings(cls, prompt: str, target_strings: dict[str, str | list[str]] | list[str] | str,
                     tokenizer: Any) -> Prompt:
        """A prompt whose targets are the first tokens of words (a bare str or list is the target ``"target"``)."""
        if isinstance(target_strings, str | list):
            target_strings = {"target": target_strings}
        tokens = {target: get_first_tokens(words, tokenizer) for target, words in target_strings.items()}
        return cls(prompt=prompt, target_tokens=tokens, target_strings=target_strings)

    def has_no_collisions(self, ignore_targets: str | list[str] | None = None) -> bool:
        """Whether no token belongs to two targets (those in ``ignore_targets`` left out)."""
        ignored = [ignore_targets] if isinstance(ignore_targets, str) else ignore_targets or []
        tokens = [t for target, ts in self.target_tokens.items() if target not in ignored for t in ts]
        return len(tokens) == len(set(tokens))

    def get_target_probs(self, probs: torch.Tensor, layer: int | None = None) -> dict[str, torch.Tensor]:
        """Each target's summed probability, ``[batch, layers]`` from ``probs`` ``[batch, layers, vocab]``."""
        summed = {target: probs[:, :, tokens].sum(dim=2).cpu() for target, tokens in self.target_tokens.items()}
        if layer is not None:
            summed = {target: value[:, layer] for target, value in summed.items()}
        return summed

    @torch.no_grad()
    def run(self, nn_model: Any, get_probs: Callable) -> dict[str, torch.Tensor]:
        """``get_probs(nn_model, prompt)`` (``[1, layers, vocab]``), summed per target."""
        return self.get_target_probs(get_probs(nn_model, self.prompt))


def next_token_probs_unsqueeze(nn_model: Any, prompt: str | list[str], remote: bool = False, **_kwargs: Any
                               ) -> torch.Tensor:
    """The next-token probabilities with a one-layer axis, ``[num_prompts, 1, vocab]``."""
    return compute_next_token_probs(nn_model, prompt, remote=remote).unsqueeze(1)


@torch.no_grad()
def run_prompts(
    nn_model: Any,
    prompts: list[Prompt],
    batch_size: int = 32,
    get_probs_func: Callable | None = None,
    func_kwargs: dict | None = None,
    remote: bool = False,
    tqdm: Any = None,
) -> dict[str, torch.Tensor]:
    """Each target's summed probability for each prompt, ``{target: [num_prompts, layers]}``.

    ``get_probs_func(nn_model, batch, remote=..., **func_kwargs)`` gives ``[batch, layers, vocab]``
    (default: next-token prediction, one layer). All prompts must have the same target names.
    """
    if not prompts:
        return {}
    keys = set(prompts[0].target_tokens)
    for prompt in prompts:
        if set(prompt.target_tokens) != keys:
            raise ValueError(f"All prompts must have the same target keys. Got {keys} and {set(prompt.target_tokens)}")
    get_probs_func = get_probs_func or next_token_probs_unsqueeze
    texts = [prompt.prompt for prompt in prompts]
    starts = range(0, len(texts), batch_size)
    if tqdm is not None:
        starts = tqdm(starts, desc="Running prompts")
    probs = torch.cat([get_probs_func(nn_model, texts[i:i + batch_size], remote=remote, **(func_kwargs or {}))
                       for i in starts])
    return {
        target: torch.stack([probs[i, :, prompt.target_tokens[target]].sum(dim=1) for i, prompt in enumerate(prompts)])
        .cpu()
        for target in prompts[0].target_tokens
    }


__all__ = ["Prompt", "TokenizationError", "get_first_tokens", "next_token_probs_unsqueeze", "run_prompts"]
