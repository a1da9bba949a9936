"""The canonical pre-norm block: ``h = x + self_attn(norm(x)); y = h + mlp(norm(h))``.

Llama and the many families that kept its block: the defaults of `Family` describe them, so a
family here is its name and the model types it serves. What differs inside the modules does not
move a value: the norm's kind or name (OLMo's parameter-free LayerNorm, Nemotron's LayerNorm1P,
Apertus' ``attention_layernorm``), the MLP (Apertus' xIELU without gate, Phi-3's and GLM's fused
``gate_up_proj``), fused or biased projections (Phi-3's ``qkv_proj``, Seed-OSS, StarCoder2),
q/k norms, partial or NoPE rotary (SmolLM3), sliding windows, OLMo's ``clip_qkv`` (in place on
q/k/v, upstream of ``o_proj``), and Youtu's multi-head latent attention (``o_proj`` still takes
the heads, ``v_head_dim`` wide). EXAONE-3, InternLM3 and IQuest-Coder are ``LlamaForCausalLM``.
Emu3's causal LM is its text model (``emu3_text_model``), and Phi-4-multimodal's text path is a
Phi-3 block whose residual dropouts are identities in eval (on text alone, its image and audio
embedding ``embed_tokens_extend`` passes the token embeddings through).

GOT-OCR2 and MOSS-Transcribe-Diarize: the causal LM is the conditional-generation class, a text model
built from ``text_config`` (Qwen2, Qwen3) under ``model.language_model`` and ``lm_head``; image or audio
features replace the embeddings of placeholder tokens, and on text alone the forward is the text model's.
Moshi's causal LM is its text decoder (``MoshiForCausalLM``, "only usable for text"): Llama blocks whose
projections are ``MoshiLinear`` wrappers around an ``nn.Linear`` (``o_proj.linear``).
"""

from dataclasses import replace

from ..served import Site
from ..versions import transformers_minor
from .base import Family

LLAMA = Family(
    name="llama",
    model_types=(
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "ministral",
        "ministral3",
        "smollm3",
        "seed_oss",
        "apertus",
        "apertus1p5_text",
        "glm",
        "helium",
        "arcee",
        "ernie4_5",
        "hunyuan_v1_dense",
        "starcoder2",
        "nemotron",
        "phi3",
        "olmo",
        "exaone",
        "internlm3",
        "iquestcoder",
        "jais2",
        "cwm",
        "youtu",
        "emu3_text_model",
        "emu3",
        "phi4_multimodal",
    ),
)

GOT_OCR2 = replace(
    LLAMA,
    name="got_ocr2",
    model_types=("got_ocr2", "moss_transcribe_diarize"),
    layers="model.language_model.layers",
    embed_tokens="model.language_model.embed_tokens",
    norm="model.language_model.norm",
)

# Before transformers 5.21 a Moshi block returns ``(hidden_states,)`` (plus the attention weights, which the
# model never asks for), from 5.21 a tensor.
MOSHI = replace(LLAMA, name="moshi", model_types=("moshi",), head_outputs=Site("self_attn.o_proj.linear", key="input"),
                block_tuple=transformers_minor() < (5, 21))

FAMILIES = [LLAMA, GOT_OCR2, MOSHI]
