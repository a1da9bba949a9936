"""What the proof runs its twins on: its prompts and a tokenizer built in code (no hub, no download)."""

from __future__ import annotations

from functools import cache
from typing import Any

_CORPUS = [
    "The Eiffel Tower is in the city of Paris.",
    "Berlin lies in Germany and Rome lies in Italy.",
    "London is the capital of England; Tokyo is the capital of Japan.",
    "Madrid, Lisbon, Vienna and Prague are cities in Europe.",
]

#: The prompts every check runs; the second is shorter, so a batch of both is left-padded.
PROMPTS = ["The Eiffel Tower is in the city of", "Berlin lies in"]


@cache
def tiny_tokenizer(vocab_size: int = 300) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens; ids 0, 1, 2 are pad, bos, eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
