"""Tiny offline models for tests, examples and ``nncanon families``: no hub, no download.

`tiny_tokenizer` trains a byte-level BPE tokenizer in code; `tiny_model` builds a registry
variant with random weights and wraps it in a `StandardizedTransformer`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from .registry import Variant, variant

_CORPUS = [
    "The Eiffel Tower is in the city of Paris.",
    "Berlin lies in Germany and Rome lies in Italy.",
    "London is the capital of England; Tokyo is the capital of Japan.",
    "Madrid, Lisbon, Vienna and Prague are cities in Europe.",
]

#: Prompts the suite runs; the second is shorter, so a batch of both is left-padded.
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


def tiny_hf_model(
    name: str | Variant,
    attn_implementation: str = "eager",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Any:
    """The bare transformers model of a registry variant, random weights from ``seed``, in eval mode.

    The weights are the model's own initialisation, each then moved off it by a little noise
    (`nncanon.proof.twin.perturb`): no bias, gain or branch stays at an exact zero or one.
    """
    import transformers

    from .proof.twin import perturb

    spec = variant(name) if isinstance(name, str) else name
    config = spec.build_config(**overrides)
    torch.manual_seed(seed)
    if spec.model_class is not None:
        config._attn_implementation = attn_implementation
        model = getattr(transformers, spec.model_class)(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    perturb(model)
    return model.to(dtype).eval()


def tiny_model(
    name: str | Variant,
    attn_implementation: str = "eager",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    verify: str = "never",
    **overrides: Any,
) -> Any:
    """A `StandardizedTransformer` over `tiny_hf_model` with `tiny_tokenizer`.

    ``verify`` defaults to ``"never"``: the invariant suite runs the checks on the variant itself
    (`nncanon.proof.verify`), which proves more than a twin of it would.
    """
    from .model import StandardizedTransformer

    hf = tiny_hf_model(name, attn_implementation=attn_implementation, seed=seed, dtype=dtype, **overrides)
    return StandardizedTransformer(hf, tokenizer=tiny_tokenizer(hf.config.get_text_config().vocab_size),
                                   verify=verify)
