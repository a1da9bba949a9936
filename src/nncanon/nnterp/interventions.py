"""nnterp 1.3's ``nnterp.interventions``: the logit lens and the patchscope lens, on nncanon's exact values.

``project_on_vocab`` here includes the family's logit post-processing (soft-capping, scaling), so
the lens at the last layer is the model's own next-token distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..tools.logit_lens import logit_lens as _lens
from .nnsight_utils import get_token_activations


@torch.no_grad()
def logit_lens(
    nn_model: Any, prompts: list[str] | str, remote: bool = False, return_inv_logits: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The next-token probabilities at the last token of each prompt, at each layer.

    Returns:
        ``[num_prompts, num_layers, vocab]`` on the CPU (and the "inverse" lens, the head applied to
        ``-norm(h)``, when ``return_inv_logits``).
    """
    if remote:
        raise NotImplementedError("nncanon.nnterp does not run on NDIF (remote=True)")
    probs = _lens(nn_model, prompts, positions=-1).softmax(-1).cpu()
    if not return_inv_logits:
        return probs
    inverse: list[torch.Tensor] = []
    with nn_model.trace(prompts if isinstance(prompts, list) else [prompts]):
        for layer in nn_model.layers:
            hidden = layer.layer_output[:, -1]
            normed = hidden if nn_model.norm is None else nn_model.norm(hidden)
            inverse.append(nn_model.lm_head(-normed).softmax(-1).cpu().save())
    return probs, torch.stack(inverse, dim=1)


@dataclass
class TargetPrompt:
    """A target prompt of a patchscope and the index of the token to patch."""

    prompt: str
    index_to_patch: int


def repeat_prompt(
    words: list[str] | None = None, rel: str = " ", sep: str = "\n", placeholder: str = "?", index_to_patch: int = -1
) -> TargetPrompt:
    """The Patchscopes paper's next-token prompt: ``"king king\\n1135 1135\\nhello hello\\n?"``."""
    if words is None:
        words = ["king", "1135", "hello"]
    return TargetPrompt(sep.join([w + rel + w for w in words]) + sep + placeholder, index_to_patch)


def it_repeat_prompt(
    tokenizer: Any,
    words: list[str] | None = None,
    rel: str = " ",
    sep: str = "\n",
    placeholder: str = "?",
    complete_prompt: bool = True,
    add_user_instr: bool = True,
    use_system_prompt: bool = True,
) -> TargetPrompt:
    """`repeat_prompt` in the tokenizer's chat template, for instruction-tuned models (patch the last token)."""
    prompt = repeat_prompt(words, rel, sep, placeholder).prompt
    answer = {"role": "assistant", "content": prompt if complete_prompt else ""}
    chat = []
    if add_user_instr:
        if use_system_prompt:
            chat.append({"role": "system", "content": "You are a helpful assistant."})
        chat += [
            {"role": "user", "content": "I will provide you with a series of sentences. Your task is to guess the "
             "next word in the sentence. You must answer with the next word only."},
            {"role": "assistant", "content": "Ok."},
            {"role": "user", "content": prompt},
        ]
    elif use_system_prompt:
        chat += [
            {"role": "system", "content": "The user will provide you with a sentence. Your task is to guess the "
             "next word in the sentence. You must answer with the next word only."},
            {"role": "user", "content": prompt},
        ]
    else:
        chat.append({"role": "user", "content": "Guess the next word in the following sentence (answer only the "
                     f"next word): {prompt}"})
    chat.append(answer)
    text = tokenizer.apply_chat_template(chat, tokenize=False, continue_final_message=True, add_special_tokens=False)
    return TargetPrompt(text, -1)


@dataclass
class TargetPromptBatch:
    """Several target prompts, each with its index to patch."""

    prompts: list[str]
    index_to_patch: torch.Tensor

    @classmethod
    def from_target_prompts(cls, prompts: list[TargetPrompt]) -> TargetPromptBatch:
        return cls([p.prompt for p in prompts], torch.tensor([p.index_to_patch for p in prompts]))

    @classmethod
    def from_target_prompt(cls, prompt: TargetPrompt, batch_size: int) -> TargetPromptBatch:
        return cls([prompt.prompt] * batch_size, torch.tensor([prompt.index_to_patch] * batch_size))

    @classmethod
    def from_prompts(
        cls, prompts: str | list[str], index_to_patch: int | list[int] | torch.Tensor
    ) -> TargetPromptBatch:
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if isinstance(index_to_patch, int):
            index_to_patch = [index_to_patch] * len(prompts)
        return cls(prompts, torch.as_tensor(index_to_patch))

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, idx: int) -> TargetPrompt:
        return TargetPrompt(self.prompts[idx], int(self.index_to_patch[idx]))

    @staticmethod
    def auto(target_prompt: Any, batch_size: int) -> TargetPromptBatch:
        if isinstance(target_prompt, TargetPrompt):
            return TargetPromptBatch.from_target_prompt(target_prompt, batch_size)
        if isinstance(target_prompt, list):
            return TargetPromptBatch.from_target_prompts(target_prompt)
        if isinstance(target_prompt, TargetPromptBatch):
            return target_prompt
        raise ValueError(f"expected a TargetPrompt, a list of them or a TargetPromptBatch, got {type(target_prompt)}")


@torch.no_grad()
def patchscope_lens(
    nn_model: Any,
    source_prompts: list[str] | str | None = None,
    target_patch_prompts: Any = None,
    layers: int | Sequence[int] | None = None,
    latents: torch.Tensor | None = None,
    remote: bool = False,
) -> torch.Tensor:
    """Patch each source's last-token ``layer_output`` into the target at the same layer; next-token probabilities.

    Returns:
        ``[num_sources, num_layers, vocab]`` on the CPU.
    """
    if remote:
        raise NotImplementedError("nncanon.nnterp does not run on NDIF (remote=True)")
    if target_patch_prompts is None:
        target_patch_prompts = repeat_prompt()
    if layers is None:
        layers = list(range(nn_model.num_layers))
    elif isinstance(layers, int):
        layers = [layers]
    if latents is None:
        if source_prompts is None:
            raise ValueError("Either source_prompts or latents must be provided")
        source_prompts = [source_prompts] if isinstance(source_prompts, str) else list(source_prompts)
        saved: list[torch.Tensor] = []
        with nn_model.trace(source_prompts):
            for layer in sorted(layers):
                saved.append(nn_model.layers[layer].layer_output[:, -1].save())
        by_layer = dict(zip(sorted(layers), saved, strict=True))
        latents = torch.stack([by_layer[layer] for layer in layers])
    elif source_prompts is not None:
        raise ValueError("You cannot provide both source_prompts and latents")
    num_sources = latents.shape[1]
    targets = TargetPromptBatch.auto(target_patch_prompts, num_sources)
    if len(targets) != num_sources:
        raise ValueError(f"Number of sources ({num_sources}) does not match number of patch prompts ({len(targets)})")
    probs: list[torch.Tensor] = []
    for index, layer in enumerate(layers):
        with nn_model.trace(targets.prompts):
            output = nn_model.layers[layer].layer_output
            output[torch.arange(num_sources), targets.index_to_patch] = latents[index].to(output)
            probs.append(nn_model.next_token_probs.cpu().save())
    return torch.stack(probs, dim=1)


@torch.no_grad()
def patchscope_generate(
    nn_model: Any,
    prompts: list[str] | str,
    target_patch_prompt: TargetPrompt,
    max_length: int = 50,
    layers: list[int] | None = None,
    remote: bool = False,
    max_batch_size: int = 32,
) -> dict[int, torch.Tensor]:
    """Patch each prompt's last-token ``layer_output`` into the target prompt at that layer, then generate.

    Returns:
        ``{layer: token ids [num_prompts, target_length + new_tokens]}`` on the CPU.
    """

    if remote:
        raise NotImplementedError("nncanon.nnterp does not run on NDIF (remote=True)")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    layers = list(range(nn_model.num_layers)) if layers is None else layers
    hiddens = get_token_activations(nn_model, prompts, layers=layers)
    generations: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(layers):
        with nn_model.generate([target_patch_prompt.prompt] * len(prompts), max_new_tokens=max_length) as tracer:
            output = nn_model.layers[layer].layer_output
            output[:, target_patch_prompt.index_to_patch] = hiddens[index].to(output)
            ids = tracer.result.save()
        generations[layer] = ids.cpu()
    return generations


@torch.no_grad()
def patch_object_attn_lens(
    nn_model: Any,
    source_prompts: list[str] | str,
    target_prompts: list[str] | str,
    attn_idx_patch: int,
    num_patches: int = 5,
) -> torch.Tensor:
    """For each layer ``l``, the attention input at ``attn_idx_patch`` of layers ``l..l+num_patches-1`` of the
    targets replaced by the sources' last-token attention input; the targets' next-token probabilities.

    Returns:
        ``[num_target_prompts, num_layers, vocab]`` on the CPU.
    """

    source_prompts = [source_prompts] if isinstance(source_prompts, str) else source_prompts
    target_prompts = [target_prompts] if isinstance(target_prompts, str) else target_prompts
    num_layers = nn_model.num_layers
    sources = get_token_activations(nn_model, source_prompts,
                                    get_activations=lambda model, layer: model.layers[layer].self_attn.input)
    probs: list[torch.Tensor] = []
    for layer in range(num_layers):
        with nn_model.trace(target_prompts):
            for patched in range(layer, min(num_layers, layer + num_patches)):
                attention_input = nn_model.layers[patched].self_attn.input
                attention_input[:, attn_idx_patch] = sources[patched].to(attention_input)
            probs.append(nn_model.next_token_probs.cpu().save())
    return torch.stack(probs, dim=1)
