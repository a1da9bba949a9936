"""The shrinking table: what every size of a config becomes in its twin (`RULES`, `Shrink`).

A twin keeps everything of a config but its sizes: the same booleans, enums, scaling factors and residual
multipliers. `RULES` is the one table of the sizes it shrinks, each a width, a count, a window or the vocabulary;
`Shrink` says how a step of the ladder applies it (the table's targets, or every width divided by one common
factor). The layers kept are remapped in every per-layer list (`keep_layers`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import NncanonError


class TwinError(NncanonError, ValueError):
    """A config that cannot be shrunk; the message names the attribute that stopped it."""


#: Target sizes of the twin.
WIDTH = 64  # the residual stream
HEADS = 4  # query heads
HEAD_WIDTH = 16  # one head
FFN = 128  # a dense MLP's inner width
EXPERT_FFN = 32  # one expert's inner width
VOCAB = 320  # tokens (the proof's tokenizer uses the first 300)
EXPERTS = 4  # routed experts
TOP_K = 2  # experts per token
WINDOW = 4  # attention windows, chunks and sparse top-k: shorter than the proof's prompts
STATE = 16  # a state-space or linear-attention state width
LORA = 32  # low-rank query/key-value projections (multi-head latent attention)
ROPE_WIDTH = 8  # the rotary part of a latent-attention head
LAYER_LIMIT = 64  # a layout that needs more blocks than this is not shrunk


#: The kinds of size a rule shrinks (see `Shrink`): a width (an axis of a weight or an activation), a count
#: (heads, experts, groups: how many of a thing), a window (a number of tokens) or the vocabulary.
WIDTH_KIND, COUNT_KIND, WINDOW_KIND, VOCABULARY_KIND = "width", "count", "window", "vocabulary"


@dataclass(frozen=True)
class Rule:
    """One line of the shrinking table: the config attributes it applies to, what kind of size they are,
    and what they become under the table's targets (``value(old, config)``, ``config``: as it was)."""

    what: str
    kind: str
    names: tuple[str, ...]
    becomes: str
    value: Callable[[Any, dict], Any]


def _at_most(limit: int) -> Callable[[Any, dict], Any]:
    return lambda old, config: min(old, limit)


def _rescale_every(old: Any, config: dict) -> Any:
    """RWKV's ``rescale_every``: the stream is halved after every such block in inference (and the later blocks'
    output weights divided to match). A twin of fewer blocks than the period would never cross a boundary, so the
    twin halves after every block (0, no rescaling, stays 0)."""
    return min(old, 1) if isinstance(old, int) and old > 0 else old


def stream_width(config: dict) -> int | None:
    return first_attribute(config, _STREAM_NAMES)


def _kv_heads(old: int, config: dict) -> int:
    heads = first_attribute(config, ("num_attention_heads", "n_head", "n_heads", "num_heads"))
    if heads is None or old >= heads:
        return min(old, HEADS)  # multi-head
    if old == 1:
        return 1  # multi-query
    return HEADS // 2  # grouped


def _experts(old: int, config: dict) -> int:
    return min(old, EXPERTS)


def _top_k(old: int, config: dict) -> int:
    experts = first_attribute(config, _EXPERT_NAMES)
    if experts is not None and old >= experts:  # every expert runs
        return min(experts, EXPERTS)
    return min(old, TOP_K)


def _groups(old: int, config: dict) -> int:
    return min(old, 2)


def _group_top_k(old: int, config: dict) -> int:
    groups = first_attribute(config, ("n_group", "num_expert_group"))
    if groups is not None and old >= groups:
        return min(groups, 2)
    return min(old, 1)


def _ssm_head_width(old: int, config: dict) -> int:
    expand = first_attribute(config, ("expand", "mamba_expand"))
    heads = first_attribute(config, ("mamba_n_heads", "mamba_num_heads"))
    if expand is not None and heads:
        return max(1, int(expand * WIDTH) // min(heads, HEADS))
    return min(old, HEAD_WIDTH * 2)


def _mlp_width(old: int, config: dict) -> int:
    """≤ `FFN`; a width equal to the stream's (RWKV's attention width, RecurrentGemma's recurrence width)
    stays equal to the twin's stream."""
    return WIDTH if old == stream_width(config) else min(old, FFN)


def _rotary_width(old: int, config: dict) -> int:
    """The rotary part of a head in the proportion it has in the config's heads (GPT-J: 64 of 256 → 4 of 16)."""
    stream, heads = stream_width(config), first_attribute(config, ("num_attention_heads", "n_head", "n_heads"))
    head = first_attribute(config, ("head_dim",)) or (stream // heads if stream and heads else None)
    if not head or old >= head:
        return min(old, HEAD_WIDTH)
    twin_head = min(head, HEAD_WIDTH) if first_attribute(config, ("head_dim",)) else WIDTH // min(heads, HEADS)
    return max(2, 2 * round(old * twin_head / head / 2))


def first_attribute(config: dict, names: tuple[str, ...]) -> Any:
    return next((config[name] for name in names if isinstance(config.get(name), int)), None)


_STREAM_NAMES = ("hidden_size", "n_embd", "d_model", "embedding_dim", "dim")
HEAD_WIDTH_NAMES = ("head_dim", "attention_head_dim", "kv_channels", "swa_head_dim", "global_head_dim",
                     "index_head_dim", "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim")
_EXPERT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

#: The shrinking table. Attributes not named here keep their value (booleans, activations, norms'
#: epsilons, rotary settings, scaling factors, multipliers, softcaps, window *kinds*...), except the
#: layer count and per-layer lists (see `twin`) and token ids that fall outside the twin's
#: vocabulary (mapped to its last ids). A size already smaller than its target is kept. The kind of
#: each row says what a twin of common factor (`Shrink`) does with it: widths are divided by the factor,
#: counts are kept, windows and the vocabulary take the table's value.
RULES: tuple[Rule, ...] = (
    Rule("stream width", WIDTH_KIND, _STREAM_NAMES, f"{WIDTH}", _at_most(WIDTH)),
    Rule("tower channels", WIDTH_KIND, ("ext_pw_out_channel", "depthwise_separable_out_channel",
                                        "nemo_conv_channels"), f"≤ {WIDTH}", _at_most(WIDTH)),
    Rule("query heads", COUNT_KIND, ("num_attention_heads", "n_head", "n_heads", "num_heads_attention"),
         f"≤ {HEADS}", _at_most(HEADS)),
    Rule("key/value heads", COUNT_KIND, ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
         f"{HEADS} (multi-head), 1 (multi-query) or {HEADS // 2} (grouped)", _kv_heads),
    Rule("head width", WIDTH_KIND, HEAD_WIDTH_NAMES, f"≤ {HEAD_WIDTH}", _at_most(HEAD_WIDTH)),
    Rule("rotary width", WIDTH_KIND, ("rotary_dim",), "its share of the twin's head width", _rotary_width),
    Rule("latent attention", WIDTH_KIND, ("q_lora_rank", "kv_lora_rank", "o_lora_rank"), f"≤ {LORA}",
         _at_most(LORA)),
    Rule("output projection groups", COUNT_KIND, ("o_groups",), "≤ 2", _at_most(2)),
    Rule("sparse-attention indexer heads", COUNT_KIND, ("index_n_heads",), f"≤ {HEADS}", _at_most(HEADS)),
    Rule("hyper-connection streams", COUNT_KIND, ("hc_mult",), "≤ 2", _at_most(2)),
    Rule("low-rank branches", WIDTH_KIND, ("laurel_rank", "adapter_rank", "gated_norm_rank"), f"≤ {LORA}",
         _at_most(LORA)),
    Rule("per-layer input width", WIDTH_KIND, ("hidden_size_per_layer_input",), f"≤ {HEAD_WIDTH}",
         _at_most(HEAD_WIDTH)),
    Rule("latent head parts", WIDTH_KIND, ("qk_nope_head_dim", "v_head_dim"), f"≤ {HEAD_WIDTH}",
         _at_most(HEAD_WIDTH)),
    Rule("latent rotary part", WIDTH_KIND, ("qk_rope_head_dim",), f"≤ {ROPE_WIDTH}", _at_most(ROPE_WIDTH)),
    Rule("MLP width", WIDTH_KIND, ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff", "dff",
                                   "dense_intermediate_size", "intermediate_size_mlp", "lru_width",
                                   "attention_hidden_size", "word_embed_proj_dim"),
         f"≤ {FFN} (the stream's width where it is the config's stream width)", _mlp_width),
    Rule("expert width", WIDTH_KIND, ("moe_intermediate_size", "shared_expert_intermediate_size",
                                      "expert_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                                      "shared_intermediate_size", "moe_ffn_hidden_size",
                                      "shared_experts_intermediate_size"), f"≤ {EXPERT_FFN}", _at_most(EXPERT_FFN)),
    Rule("vocabulary", VOCABULARY_KIND, ("vocab_size", "vocab_size_per_layer_input"), f"{VOCAB}", _at_most(VOCAB)),
    Rule("routed experts", COUNT_KIND, (*_EXPERT_NAMES, "zero_expert_num"), f"≤ {EXPERTS}", _experts),
    Rule("experts per token", COUNT_KIND, ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k",
                                           "moe_top_k", "moe_k"),
         f"≤ {TOP_K} (all experts where all run)", _top_k),
    Rule("expert groups", COUNT_KIND, ("n_group", "num_expert_group"), "≤ 2", _groups),
    Rule("groups per token", COUNT_KIND, ("topk_group",), "≤ 1 (all groups where all are chosen)", _group_top_k),
    Rule("linear-attention heads", COUNT_KIND, ("linear_num_key_heads",), "≤ 2", _at_most(2)),
    Rule("linear-attention value heads", COUNT_KIND, ("linear_num_value_heads", "linear_num_heads"), "≤ 4",
         _at_most(4)),
    Rule("state-space heads", COUNT_KIND, ("mamba_n_heads", "mamba_num_heads"), f"≤ {HEADS}", _at_most(HEADS)),
    Rule("state-space head width", WIDTH_KIND, ("mamba_d_head", "mamba_head_dim", "mamba_headdim"),
         "expand × stream width / heads", _ssm_head_width),
    Rule("state width", WIDTH_KIND, ("d_state", "ssm_state_size", "mamba_d_state", "state_size"), f"≤ {STATE}",
         _at_most(STATE)),
    Rule("state-space groups", COUNT_KIND, ("n_groups", "mamba_n_groups"), "≤ 2", _groups),
    Rule("time-step rank", WIDTH_KIND, ("time_step_rank", "mamba_dt_rank", "dt_rank"), f"≤ {STATE}",
         _at_most(STATE)),
    Rule("windows and chunks", WINDOW_KIND, ("sliding_window", "window_size", "attention_window_size",
                                             "sliding_window_size", "attention_chunk_size", "chunk_size",
                                             "mamba_chunk_size", "local_attention", "index_topk", "block_size",
                                             "index_block_size", "index_compression", "index_num_local_tokens",
                                             "index_num_sink_tokens"),
         f"≤ {WINDOW} tokens, so the proof's prompts cross them", _at_most(WINDOW)),
    Rule("sparse-attention key pools", WINDOW_KIND, ("index_pool_size",), f"≤ {2 * WINDOW} tokens",
         _at_most(2 * WINDOW)),
    Rule("stream rescaling period", COUNT_KIND, ("rescale_every",),
         "≤ 1 block (RWKV halves the stream after every such block: the twin's blocks cross it)", _rescale_every),
)

_RULE_OF = {name: rule for rule in RULES for name in rule.names}

#: Attributes holding the layer count.
LAYER_COUNT = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_blocks")
#: A list of layer indices (remapped, not sliced): strictly increasing ints under one of these names.
_INDEX_LIST = re.compile(r"(idxs|_ids|indices|_layers)$")
#: Attributes that are token ids.
_TOKEN_ID = re.compile(r"(_token_id|_token_index|_token_ids)$")
#: Each block's own sizes, by layer index (a heterogeneous config: Dots3-Note, Gemma-4).
PER_LAYER = "per_layer_config"
#: Sub-configs shrunk with the same table (a multimodal checkpoint's towers).
NESTED = re.compile(r"_config$")


@dataclass(frozen=True)
class Change:
    """One attribute the twin changed: ``config.path`` from ``old`` to ``new``, by ``rule``."""

    path: str
    old: Any
    new: Any
    rule: str


@dataclass(frozen=True)
class Shrink:
    """How a twin's sizes are made from the config's: one step of the ladder (`nncanon.proof.ladder`).

    ``factor`` 0: the table's targets (`RULES`), the smallest twin. ``factor`` n ≥ 1: every width of the
    table divided by n (rounded up), every count (heads, experts, groups) kept, so every proportion between
    sizes holds as in the config, named in the table or not (a rotary width and its head, heads × head width
    and the stream, state-space heads × head width and ``expand ×`` the stream); ``factor`` 1 keeps the
    config's widths. ``windows``: windows and chunks take the table's value (else the config's). The
    vocabulary always takes the table's, and the layers are chosen as `build_twin` says.
    """

    factor: int = 0
    windows: bool = True

    @property
    def table(self) -> bool:
        return self.factor == 0

    def describe(self) -> str:
        """``the table's sizes``, ``widths ÷ 16, counts kept``, ``the config's widths``..."""
        if self.table:
            return "the table's sizes"
        if self.factor == 1:
            return "the config's widths and counts" + ("" if self.windows else " and windows")
        return f"every width ÷ {self.factor}, counts kept"

    def value(self, rule: Rule, old: int, config: dict) -> int:
        """What ``old`` (an attribute of ``rule``, in ``config`` as it was) becomes."""
        if self.table or rule.kind == VOCABULARY_KIND or (rule.kind == WINDOW_KIND and self.windows):
            return rule.value(old, config)
        if rule.kind == WIDTH_KIND:
            return -(-old // self.factor)
        return old


#: The table's targets: the first step of the ladder.
TABLE = Shrink()


def shrink_sizes(config: dict, path: str, changes: list[Change], shrink: Shrink = TABLE) -> None:
    """Shrink ``config`` (a config as a dict) in place as ``shrink`` says, recording each change. Nested
    configs other than the text model's (a multimodal checkpoint's towers) take the table's targets."""
    original = dict(config)  # the rules read the config as it was
    text = text_part(config)[0]
    for name in list(config):
        value = config[name]
        if isinstance(value, dict) and NESTED.search(name) and "model_type" in value:
            shrink_sizes(value, f"{path}{name}.", changes, shrink if value is text else TABLE)
            continue
        if name == PER_LAYER and isinstance(value, dict):  # each block's own sizes: after the global ones
            continue
        rule = _RULE_OF.get(name)
        if rule is not None and _sizes(value):  # one size per block (Gemma-3n's intermediate_size)
            new = type(value)(shrink.value(rule, v, original) for v in value)
        elif rule is None or isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            continue
        else:
            new = shrink.value(rule, value, original)
        if new != value:
            config[name] = new
            changes.append(Change(path + name, value, new, rule.what))
    _keep_relations(config, original, path, changes)
    for layer, own in (config.get(PER_LAYER) or {}).items():
        if isinstance(own, dict):  # a block's own sizes override the global ones: its relations read both
            before = dict(own)
            shrink_sizes(own, f"{path}{PER_LAYER}.{layer}.", changes, shrink)
            merged = {**config, **own}
            _keep_relations(merged, {**original, **before}, f"{path}{PER_LAYER}.{layer}.", changes)
            own.update({k: v for k, v in merged.items() if k in own or merged[k] != config.get(k)})


def widest_factor(config: Any) -> int:
    """The largest common factor the ladder divides ``config``'s widths by: the largest power of two that
    takes its text model's stream width to at least `WIDTH` and divides it (1 where none does)."""
    values = config.to_dict() if not isinstance(config, dict) else config
    stream = stream_width(text_part(values)[0])
    factor = 1
    while stream and stream % (factor * 2) == 0 and stream // (factor * 2) >= WIDTH:
        factor *= 2
    return factor


def _sizes(value: Any) -> bool:
    """Whether ``value`` is a list of positive sizes (one per block)."""
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value))


def _set(config: dict, name: str, value: Any, path: str, changes: list[Change], why: str) -> None:
    if name in config and config[name] != value:
        changes.append(Change(path + name, config[name], value, why))
        config[name] = value


def _keep_relations(config: dict, original: dict, path: str, changes: list[Change]) -> None:
    """Sizes another size is defined by, kept consistent after the table ran (``original``: before)."""
    heads = first_attribute(config, ("num_attention_heads", "n_head", "n_heads"))
    kv = first_attribute(config, ("num_key_value_heads", "num_kv_heads"))
    if heads and kv and heads % kv:
        _set(config, "num_key_value_heads" if "num_key_value_heads" in config else "num_kv_heads", 1, path,
             changes, "key/value heads divide the query heads")
    if isinstance(config.get("qk_rope_head_dim"), int):
        rope, nope = config["qk_rope_head_dim"], config.get("qk_nope_head_dim") or 0
        if original.get("head_dim") == original["qk_rope_head_dim"]:  # the rotary part is the head width
            _set(config, "head_dim", rope, path, changes, "head width = latent rotary part")
        elif original.get("head_dim") == original["qk_rope_head_dim"] + (original.get("qk_nope_head_dim") or 0):
            _set(config, "head_dim", rope + nope, path, changes, "head width = rotary + non-rotary part")
        if isinstance(config.get("qk_head_dim"), int):
            _set(config, "qk_head_dim", rope + nope, path, changes, "latent head = rotary + non-rotary part")
    scorers = config.get("index_num_heads")
    if isinstance(scorers, int) and heads and kv and scorers > heads // kv:  # Kolibri-1.1's indexer
        _set(config, "index_num_heads", heads // kv, path, changes, "indexer heads ≤ query heads of one key head")
    pool, compression = config.get("index_pool_size"), config.get("index_compression")
    if isinstance(pool, int) and isinstance(compression, int) and compression > 0 and pool % compression:
        _set(config, "index_pool_size", compression * max(1, pool // compression), path, changes,
             "the key pool is whole compressed blocks")
    rates = config.get("compress_rates")
    if isinstance(rates, dict) and all(isinstance(v, int) for v in rates.values()):  # DeepSeek-V4's, per block kind
        _set(config, "compress_rates", {kind: min(rate, WINDOW) for kind, rate in rates.items()}, path, changes,
             f"compression rates ≤ {WINDOW} tokens, so the proof's prompts have compressed entries")
    experts = first_attribute(config, _EXPERT_NAMES)
    groups = config.get("n_group")
    if experts and isinstance(groups, int) and groups > 1 and experts % groups:
        _set(config, "n_group", 1, path, changes, "expert groups divide the experts")
    heads_ssm = first_attribute(config, ("mamba_n_heads", "mamba_num_heads"))
    groups_ssm = first_attribute(config, ("n_groups", "mamba_n_groups"))
    if heads_ssm and groups_ssm and heads_ssm % groups_ssm:
        name = "n_groups" if "n_groups" in config else "mamba_n_groups"
        _set(config, name, 1, path, changes, "state-space groups divide its heads")
    expand = config.get("expand")
    if isinstance(config.get("num_heads"), int) and isinstance(config.get("head_dim"), int) and expand:
        width = first_attribute(config, ("hidden_size", "d_model"))
        if width and config["num_heads"] * config["head_dim"] != int(expand * width):
            _set(config, "num_heads", min(config["num_heads"], HEADS), path, changes, "state-space heads")
            _set(config, "head_dim", max(1, int(expand * width) // config["num_heads"]), path, changes,
                 "state-space heads × head width = expand × stream width")
    if isinstance(config.get("mamba_d_ssm"), int) and heads_ssm:
        width = first_attribute(config, ("mamba_d_head", "mamba_head_dim"))
        if width:
            _set(config, "mamba_d_ssm", heads_ssm * width, path, changes, "state-space width = heads × head width")
    _remap_token_ids(config, path, changes)


def _remap_token_ids(config: dict, path: str, changes: list[Change]) -> None:
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int):
        return
    mapped: dict[int, int] = {}

    def remap(value: int) -> int:
        if value < vocab:
            return value
        if value not in mapped:
            mapped[value] = vocab - 1 - len(mapped)
        return mapped[value]

    for name in sorted(config):
        value = config[name]
        if not _TOKEN_ID.search(name) and name not in ("pad_token_id", "bos_token_id", "eos_token_id"):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            _set(config, name, remap(value), path, changes, "token ids inside the twin's vocabulary")
        elif isinstance(value, list) and all(isinstance(v, int) for v in value):
            _set(config, name, [remap(v) for v in value], path, changes, "token ids inside the twin's vocabulary")


def layer_count_of(values: dict) -> int:
    """The number of blocks of a config (as a dict): its layer count, or the length of its per-layer
    block-type list where the count is derived from it (Nemotron-H)."""
    for name in LAYER_COUNT:
        if isinstance(values.get(name), int):
            return values[name]
    for name in _BLOCK_TYPE_LISTS:
        if isinstance(values.get(name), (list, str)):
            return len(values[name])
    raise TwinError(f"the config has no layer count ({', '.join(LAYER_COUNT + _BLOCK_TYPE_LISTS)})")


#: Counts of the last blocks that behave differently (Gemma-3n's last ``num_kv_shared_layers`` reuse
#: earlier blocks' keys/values): the twin counts the blocks it keeps among them.
_TRAILING_COUNT = ("num_kv_shared_layers",)
#: Per-layer lists whose entries are layer indices (Kolibri-1.1's ``kv_source_layers``: the block whose
#: keys/values each block reads): sliced to the twin's blocks and renumbered; a choice of blocks that
#: leaves out a block another kept block reads fails.
_SOURCE_LISTS = ("kv_source_layers",)
#: Per-layer lists a layer count may be derived from.
_BLOCK_TYPE_LISTS = ("layers_block_type", "layer_types", "hybrid_override_pattern", "block_types")


def keep_layers(config: dict, keep: list[int], count: int, path: str, changes: list[Change]) -> None:
    """Make ``config`` (a dict, with its ``count`` blocks) a config of the blocks ``keep``, in order."""
    position = {old: new for new, old in enumerate(keep)}
    for name in list(config):
        value = config[name]
        if name in LAYER_COUNT and value == count:
            config[name] = len(keep)
        elif name in _TRAILING_COUNT and isinstance(value, int) and 0 < value <= count:
            config[name] = sum(1 for i in keep if i >= count - value)
        elif name == PER_LAYER and isinstance(value, dict):
            config[name] = {str(position[int(i)]): own for i, own in value.items() if int(i) in position}
        elif isinstance(value, str) and len(value) == count and count > 1:
            config[name] = "".join(value[i] for i in keep)
        elif name in _SOURCE_LISTS and isinstance(value, (list, tuple)) and len(value) == count:
            config[name] = type(value)(position[value[i]] for i in keep)  # KeyError: a source left out
        elif isinstance(value, (list, tuple)) and value and _is_index_list(name, value, count):
            config[name] = type(value)(position[i] for i in value if i in position)
        elif isinstance(value, (list, tuple)) and len(value) == count and count > 1:
            config[name] = type(value)(value[i] for i in keep)
        else:
            continue
        if config[name] != value:
            changes.append(Change(path + name, value, config[name], "the twin's blocks"))


def _is_index_list(name: str, value: Any, count: int) -> bool:
    if not _INDEX_LIST.search(name) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return False
    return all(0 <= v < count for v in value) and all(a < b for a, b in itertools.pairwise(value))


def text_part(config: dict) -> tuple[dict, str]:
    """The (sub-)dict whose blocks are the causal LM's: a multimodal config's text config, else itself."""
    for name in ("text_config", "language_config", "llm_config"):
        if isinstance(config.get(name), dict) and "model_type" in config[name]:
            return config[name], f"{name}."
    return config, ""
