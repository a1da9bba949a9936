"""Model types of transformers' causal-LM mapping that nncanon does not serve, and why.

nncanon serves decoder-only language models whose blocks add their sublayers' outputs to one
residual stream (or a documented few streams). transformers' ``AutoModelForCausalLM`` also maps
encoders run as decoders, the decoder halves of encoder-decoder models, a few decoders whose
stream is not a sum of block contributions, and audio-code decoders that are not text models.
Loading one raises `OutOfScopeModel` with the reason below instead of a generic "no family" error.
"""

from __future__ import annotations

#: Bidirectional encoders pretrained with masked-language modelling, which transformers can run
#: with a causal mask as a decoder (``is_decoder=True``).
ENCODERS: tuple[str, ...] = (
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm", "xlm-roberta", "xlm-roberta-xl",
    "xmod",
)

#: Decoder halves of encoder-decoder models: their blocks cross-attend to an encoder's states.
ENCODER_DECODER_HALVES: tuple[str, ...] = (
    "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus", "plbart",
    "prophetnet", "trocr", "whisper",
)

_ENCODER = (
    "{model_type} is an encoder (bidirectional, pretrained with masked-language modelling) that "
    "transformers can run as a decoder with a causal mask; encoders used as decoders are out of "
    "nncanon's scope, which is decoder-only language models"
)
_HALF = (
    "{model_type}'s causal-LM class is the decoder half of an encoder-decoder model: its blocks "
    "cross-attend to an encoder's output, so it is not a decoder-only language model and is out of "
    "nncanon's scope"
)

#: Decoders whose blocks do not add their contributions to one residual stream, with the reason.
NOT_A_RESIDUAL_SUM: dict[str, str] = {
    "cpmant": (
        "CPM-Ant prepends `prompt_length` learned prompt tokens inside its forward, so every block's "
        "stream is [b, prompt_length + s, d] and its positions are not the input's tokens; its blocks add "
        "the residual inside their attention and feed-forward modules, and the prompt positions are cut off "
        "only after the last block"
    ),
    "dory": (
        "Dory is an nGPT model: each block normalises the stream onto the unit sphere and interpolates "
        "towards each normalised sublayer output, h = x̂ + α ⊙ (norm(attn(x̂)) − x̂) with learned per-channel "
        "rates α, so the stream is not a sum of what the sublayers add"
    ),
    "hrm_text": (
        "HRM runs two stacks of blocks (H and L) in nested loops, H_cycles × (L_cycles + 1) calls per "
        "forward, each stack reading the sum of both stacks' states: a block runs several times per "
        "token with different inputs, so there is no one layers[i] input or output, and the two "
        "interleaved states are not one residual stream"
    ),
    "inkling2_text": (
        "Inkling-2's blocks use block attention residuals: each block's input is a learned attention over "
        "the outputs of every earlier block (softmax-weighted, input-dependent), not the previous block's "
        "output plus its contribution, so there is no residual stream whose sum the sublayers add to"
    ),
    "inkling2_loop_text": (
        "Inkling-2-Loop has Inkling-2's block attention residuals (each block's input is a learned "
        "attention over every earlier block's output, not a residual sum) and also runs its loop layers "
        "`loop_num_passes` times per forward, passing messages between passes"
    ),
    "gemma4_assistant": (
        "Gemma-4's assistant is a speculative-decoding drafter: it ignores input_ids and reads the target "
        "model's hidden states (projected from 2 × backbone_hidden_size) and its shared key/value states, so "
        "it is not a language model that runs on text by itself"
    ),
    "gemma4_unified_assistant": (
        "Gemma-4-unified's assistant is a speculative-decoding drafter: it ignores input_ids and reads the "
        "target model's hidden states (projected from 2 × backbone_hidden_size) and its shared key/value "
        "states, so it is not a language model that runs on text by itself"
    ),
    "blt": (
        "BLT (Byte Latent Transformer) runs three stacks on two sequence axes: a local encoder over bytes, "
        "a global transformer over patches of bytes (fewer positions, grouped by an entropy patcher) that it "
        "reaches by cross-attention, and a local decoder over bytes that cross-attends back to the patches; "
        "there is no one [b, s, d] residual stream over the input tokens that every block adds to"
    ),
    "xlnet": (
        "XLNet is a permutation language model with two-stream attention (a content stream and a query "
        "stream), not a decoder-only model with one residual stream"
    ),
    "reformer": (
        "Reformer's blocks are reversible residual layers over two streams (y1 = x1 + attn(x2), "
        "y2 = x2 + ff(y1)), with LSH or chunked attention, not one residual stream"
    ),
    "git": (
        "GIT's text decoder is a BERT-style post-norm stack: each block computes LayerNorm(x + attention) and "
        "then LayerNorm(h + feed-forward), so the stream is re-normalised after every sublayer and is not a sum "
        "of what the sublayers add; it is an image-captioning decoder whose text tokens attend to image-patch "
        "tokens prepended to the sequence"
    ),
}

#: Decoders in the causal-LM mapping that are not text language models, with the reason.
NOT_TEXT: dict[str, str] = {
    "musicgen": (
        "MusicGen's causal LM is the audio decoder of a text-to-music encoder-decoder: its input is "
        "num_codebooks parallel streams of EnCodec audio codes ([batch · num_codebooks, seq], their embeddings "
        "summed), it has one head per codebook (logits [batch, num_codebooks, seq, audio vocabulary]), and its "
        "blocks cross-attend to the text encoder's states; it is not a language model over text tokens"
    ),
    "musicgen_melody": (
        "MusicGen-Melody's causal LM is an audio decoder: its input is num_codebooks parallel streams of EnCodec "
        "audio codes ([batch · num_codebooks, seq], their embeddings summed), it has one head per codebook, and "
        "its conditioning (text encoder and chroma states) is prepended to the sequence; it is not a language "
        "model over text tokens"
    ),
}


def out_of_scope_reason(model_type: str | None) -> str | None:
    """Why transformers' ``model_type`` is out of nncanon's scope, or ``None`` if it is not known to be."""
    if model_type in ENCODERS:
        return _ENCODER.format(model_type=model_type)
    if model_type in ENCODER_DECODER_HALVES:
        return _HALF.format(model_type=model_type)
    return NOT_A_RESIDUAL_SUM.get(model_type) or NOT_TEXT.get(model_type)


#: Decoder-only text types not served yet, with what is missing (their error stays `UnknownFamilyError`).
NOT_YET: dict[str, str] = {}

