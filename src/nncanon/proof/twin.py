"""`twin`: a small random-weight copy of a decoder config that keeps everything but the sizes.

The twin of a config is what the load-time proof checks every value on: the same model class, the
same booleans, enums, scaling factors and residual multipliers, the same kinds of blocks in the same
order, with every width, head count, vocabulary and expert count shrunk by one table (`RULES`) so
that the whole proof runs in about a second on a CPU. Its weights are random (a fixed seed) and then
perturbed, so that norms, biases and gates that initialise to zeros or ones are generic.

Layers: the twin keeps the shortest prefix of blocks that holds every kind of block the original
has, plus the last block. A block's kind is its structure (the classes of its submodules and their
per-layer settings) and its entries in the config's per-layer lists (``layer_types``...); the twin
is accepted only if each of its blocks has the kind of the block it stands for.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..quantization import Quantization
from ..quiet import progress_bars_hidden
from .shrink import (
    HEAD_WIDTH_NAMES,
    LAYER_LIMIT,
    NESTED,
    PER_LAYER,
    TABLE,
    Change,
    Shrink,
    TwinError,
    first_attribute,
    keep_layers,
    layer_count_of,
    shrink_sizes,
    stream_width,
    text_part,
)

# -- block kinds -------------------------------------------------------------------------------

_SKIPPED_SETTINGS = re.compile(r"(^|_)(idx|index|id|number|num|layers|depth|source_layer)$|^layer_|^training$")


def _settings(module: torch.nn.Module) -> tuple:
    """A module's own scalar settings (``sliding_window``, ``is_causal``...), not its index."""
    items = []
    for name, value in vars(module).items():
        if name.startswith("_") or _SKIPPED_SETTINGS.search(name):
            continue
        if value is None or isinstance(value, (bool, int, str)):
            items.append((name, value))
        elif isinstance(value, float):  # not its value (scales vary with depth), but whether it is zero:
            items.append((name, value == 0.0))  # a rate that switches code on (Gemma-3n's activation sparsity)
    return tuple(sorted(items))


def block_kind(block: torch.nn.Module) -> tuple:
    """The kind of a block: the class and settings of it and every submodule, by relative path.

    Experts are collapsed (``experts.0``, ``experts.1`` are one entry), so a block's kind does not
    depend on how many experts it has.
    """
    entries = {}
    for name, module in block.named_modules():
        name = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        entries[name] = (type(module).__name__, _settings(module))
    return tuple(sorted(entries.items()))


_TOWER = re.compile(r"vision|visual|audio|image|encoder")


def blocks_of(model: torch.nn.Module, count: int, path: str | None = None) -> torch.nn.ModuleList:
    """The model's list of ``count`` blocks: the module at ``path`` (a registered family's), else the
    ``ModuleList`` of ``count`` modules outside any vision or audio tower."""
    if path is not None:
        return model.get_submodule(path)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and not _TOWER.search(name):
            if not all(isinstance(m, torch.nn.Linear) for m in module):
                return module
    raise TwinError(f"{type(model).__name__} has no list of {count} blocks")


def _uniform_settings(kinds: list[tuple]) -> set:
    """The ``(path, name)`` settings that have one value wherever they occur in ``kinds``."""
    values: dict = {}
    for kind in kinds:
        for path, (_, settings) in kind:
            for name, value in settings:
                values.setdefault((path, name), set()).add(repr(value))
    return {key for key, seen in values.items() if len(seen) == 1}


def same_kinds(wide: list[tuple], keep: list[int], built: list[tuple]) -> bool:
    """Whether ``built[j]`` has the kind of ``wide[keep[j]]`` for every ``j``, leaving out settings that
    have one value in each model (a count that follows the depth, the same on every block)."""
    if len(built) != len(keep):
        return False
    names = _uniform_settings(wide) & _uniform_settings(built)

    def strip(kind: tuple) -> tuple:
        return tuple(
            (path, (cls, tuple(s for s in settings if (path, s[0]) not in names))) for path, (cls, settings) in kind
        )

    return all(strip(built[j]) == strip(wide[i]) for j, i in enumerate(keep))


# -- building ----------------------------------------------------------------------------------


def model_class_for(config: Any) -> type:
    """The class transformers builds a causal LM of ``config`` with."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as error:
        raise TwinError(f"transformers has no causal LM for {type(config).__name__}") from error


#: Config entries a twin is built without: the twin is built in float32 and unquantized, then quantized or cast as
#: the model is (`quantized_twin`).
_NOT_BUILT = ("transformers_version", "_name_or_path", "quantization_config")


def _config_from(template: Any, values: dict) -> Any:
    values = {k: v for k, v in values.items() if k not in _NOT_BUILT}
    built = type(template).from_dict(copy.deepcopy(values))
    built._attn_implementation = "eager"
    return built


def _build(cls: type, config: Any, device: str) -> torch.nn.Module:
    with torch.device(device):
        if hasattr(cls, "_from_config"):
            return cls._from_config(config, attn_implementation="eager")
        return cls(config)


class TwinTooLarge(TwinError):
    """A step of the ladder whose twin would have more parameters than the budget allows."""


@dataclass
class Twin:
    """A built twin: the model, the config it was built from, and how it maps onto the original.

    Attributes:
        model: The twin, random weights, fp32, eval mode, on the CPU.
        config: The twin's config.
        stands_for: ``stands_for[j]`` is the original block twin block ``j`` has the kind of.
        kinds: The kind of every original block (`block_kind`).
        changes: Every attribute the twin changed.
        shrink: How its sizes were made (`Shrink`: the table's targets, or a common factor).
        parameters: Its number of parameters.
    """

    model: torch.nn.Module
    config: Any
    stands_for: list[int]
    kinds: list[tuple]
    changes: list[Change]
    shrink: Shrink = TABLE
    parameters: int = 0

    def block_for(self, layer: int) -> int | None:
        """The twin block that proves original block ``layer``: the one standing for it, or the first
        of its kind; ``None`` where the twin has no block of that kind."""
        if layer in self.stands_for:
            return self.stands_for.index(layer)
        kind = self.kinds[layer]
        return next((j for j, old in enumerate(self.stands_for) if self.kinds[old] == kind), None)

    def sizes(self) -> dict[str, Any]:
        """The twin's sizes, as the proof's provenance states them: its stream width, heads, head width,
        blocks (and of how many), vocabulary and parameters."""
        text = self.config.get_text_config()
        values = text.to_dict()
        heads = first_attribute(values, ("num_attention_heads", "n_head", "n_heads"))
        sizes = {"width": stream_width(values), "heads": heads,
                 "head_width": first_attribute(values, HEAD_WIDTH_NAMES), "blocks": len(self.stands_for),
                 "of_blocks": len(self.kinds), "vocabulary": values.get("vocab_size"), "parameters": self.parameters}
        if sizes["head_width"] is None and sizes["width"] and sizes["heads"]:
            sizes["head_width"] = sizes["width"] // sizes["heads"]
        return sizes


def shrunk_values(config: Any, shrink: Shrink = TABLE) -> tuple[dict, list[Change]]:
    """``config`` as a dict with ``shrink``'s sizes applied (every block kept), and the changes."""
    values = copy.deepcopy(config.to_dict())
    changes: list[Change] = []
    _drop_absorbed(config, values, changes)
    shrink_sizes(values, "", changes, shrink)
    return values, changes


def _drop_absorbed(config: Any, values: dict, changes: list[Change]) -> None:
    """Drop from ``values`` (``config`` as a dict) each legacy ``*_config`` dict of sizes that the config class
    has already read into its own attributes (Kimi-Linear's ``linear_attn_config``: ``head_dim``, ``num_heads``
    become ``linear_head_dim``, ``linear_num_heads``): rebuilt from ``values``, it would override the shrunk
    attributes with the full sizes. A dict is dropped only where the config built without it is the same."""
    text, path = text_part(values)
    for name in [n for n, v in text.items() if NESTED.search(n) and isinstance(v, dict) and "model_type" not in v
                 and n != PER_LAYER]:
        trial = copy.deepcopy(values)
        del text_part(trial)[0][name]
        try:
            same = _without(_config_from(config, trial), name) == _without(_config_from(config, values), name)
        except Exception:
            continue
        if same:
            changes.append(Change(path + name, text[name], None, "read into the config's own attributes"))
            del text[name]


def _without(config: Any, name: str) -> dict:
    """``config.to_dict()`` without ``name`` in its text part and without what varies between builds."""
    values = config.to_dict()
    text_part(values)[0].pop(name, None)
    values.pop("transformers_version", None)
    return values


def shrunk_config(config: Any, shrink: Shrink = TABLE) -> tuple[Any, list[Change]]:
    """``config`` with ``shrink``'s sizes applied (every block kept), and the changes."""
    values, changes = shrunk_values(config, shrink)
    try:
        return _config_from(config, values), changes
    except Exception as error:
        raise TwinError(_culprit(config, values, changes, error) if shrink.table else _failed(config, shrink, error)
                        ) from error


def _failed(config: Any, shrink: Shrink, error: Exception) -> str:
    return f"{type(config).__name__} with {shrink.describe()} does not build: {type(error).__name__}: {error}"


def _builds(config: Any, values: dict, cls: type | None) -> bool:
    try:
        built = _config_from(config, values)
        if cls is not None:
            _build(cls, built, "meta")
    except Exception:
        return False
    return True


def _culprit(config: Any, values: dict, changes: list[Change], error: Exception, cls: type | None = None) -> str:
    """The message for a config that does not shrink: the change whose reverting alone makes it build,
    or that transformers cannot build the config at full size either."""
    for change in changes:
        trial = copy.deepcopy(values)
        _put_path(trial, change.path, change.old)
        if _builds(config, trial, cls):
            return (
                f"{type(config).__name__} cannot be shrunk: setting {change.path} ({change.rule}) from "
                f"{change.old} to {change.new} fails: {type(error).__name__}: {error}"
            )
    if cls is not None and not _builds(config, config.to_dict(), cls):
        return (
            f"transformers cannot build {cls.__name__} from this {type(config).__name__} at full size either "
            f"({type(error).__name__}: {error}); the config is not one the model class takes"
        )
    return f"{type(config).__name__} cannot be shrunk: {type(error).__name__}: {error}"


def _put_path(values: dict, path: str, value: Any) -> None:
    *parents, name = path.split(".")
    for parent in parents:
        values = values[parent]
    values[name] = value


def _choose_layers(kinds: list[tuple], times: int = 1) -> list[int]:
    """The shortest prefix holding every kind but the last block's (each ``times`` times, where the
    model has it that often), and the last block."""
    seen: dict = {}
    end = 0
    for index, kind in enumerate(kinds[:-1]):
        seen[kind] = seen.get(kind, 0) + 1
        if seen[kind] <= times:
            end = index
    keep = list(range(end + 1))
    if keep[-1] != len(kinds) - 1:
        keep.append(len(kinds) - 1)
    return keep


def _first_of_each(kinds: list[tuple]) -> list[int]:
    """The first block of each kind, and the first and last blocks."""
    first: dict = {}
    for index, kind in enumerate(kinds):
        first.setdefault(kind, index)
    return sorted({0, len(kinds) - 1, *first.values()})


def _layer_choices(kinds: list[tuple]) -> list[list[int]]:
    """The choices of blocks to try: the first block of each kind (and the last); a prefix with every
    kind and the last block; the prefix alone; every kind twice (blocks that share weights with a
    later one); every block. A choice holds if the twin built from it has the kinds it stands for."""
    once, twice = _choose_layers(kinds), _choose_layers(kinds, times=2)
    choices = [_first_of_each(kinds), once, once[:-1], twice, list(range(len(kinds)))]
    unique = []
    for choice in choices:
        if choice and choice not in unique and len(choice) <= LAYER_LIMIT:
            unique.append(choice)
    return unique


def build_twin(config: Any, seed: int = 0, model_class: type | None = None, blocks: str | None = None,
               shrink: Shrink = TABLE, max_parameters: int | None = None) -> Twin:
    """Build one twin of ``config``: same model class, same settings, its sizes shrunk as ``shrink`` says.

    The load-time proof takes the first step of the ladder whose twin runs (`nncanon.proof.ladder.running_twin`);
    this builds the twin of one step, runs nothing.

    Args:
        config: A transformers config (a hub checkpoint's, a local folder's, or one built in code).
        seed: The seed of the random weights (the caller's random state is left as it was).
        model_class: The model class to build (default: transformers' causal LM for the config).
        blocks: The path of the list of blocks in the model (default: the ``ModuleList`` with as many
            modules as the config has layers, outside any vision or audio tower).
        shrink: How the sizes are made (default: the table's targets, `RULES`).
        max_parameters: Raise `TwinTooLarge` (before any weight is made) where the twin would have more.

    Raises:
        TwinError: naming the attribute that stopped the shrinking (`TwinTooLarge`: over ``max_parameters``).
    """
    cls = model_class or model_class_for(config)
    wide, changes = shrunk_config(config, shrink)
    wide_values = wide.to_dict()
    text, path = text_part(wide_values)
    count = layer_count_of(text)
    try:
        skeleton = _build(cls, wide, "meta")
    except Exception as error:
        message = _culprit(config, wide_values, changes, error, cls) if shrink.table else _failed(config, shrink, error)
        raise TwinError(message) from error
    kinds = [block_kind(block) for block in blocks_of(skeleton, count, blocks)]
    for keep in _layer_choices(kinds):
        values = copy.deepcopy(wide_values)
        layer_changes: list[Change] = []
        try:
            keep_layers(text_part(values)[0], keep, count, path, layer_changes)
            small = _config_from(config, values)
            built = _build(cls, small, "meta")
            built_kinds = [block_kind(block) for block in blocks_of(built, len(keep), blocks)]
        except Exception:
            continue
        if same_kinds(kinds, keep, built_kinds):
            parameters = parameter_count(built)
            if max_parameters is not None and parameters > max_parameters:
                raise TwinTooLarge(f"its twin with {shrink.describe()} would have {parameters / 1e6:.0f}M parameters, "
                                   f"over the budget of {max_parameters / 1e6:.0f}M")
            return Twin(_real(cls, small, seed), small, keep, kinds, changes + layer_changes, shrink, parameters)
    raise TwinError(
        f"{type(config).__name__} cannot be shrunk: no choice of at most {LAYER_LIMIT} of its {count} blocks "
        f"keeps every block's kind (its layout: num_hidden_layers and the per-layer attributes)"
    )


def _real(cls: type, config: Any, seed: int) -> torch.nn.Module:
    """The twin with random weights from ``seed``, each parameter then moved off its initial value."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build(cls, config, "cpu").float().eval()
        perturb(model)
    return model


def quantized_twin(model: torch.nn.Module, quantization: Quantization | None) -> torch.nn.Module:
    """``model`` (a float32 twin) quantized or cast as ``quantization`` says: loaded by transformers'
    ``from_pretrained`` from its own weights with the model's ``quantization_config`` and ``dtype``, as the user's
    model was (the same quantizer, the same layers replaced, the same compute dtype); only cast where the model is
    only cast. ``None``: ``model`` itself. Raises what transformers or the quantizer raise."""
    if quantization is None:
        return model
    if quantization.method is None:
        return model.to(quantization.dtype)
    config = copy.deepcopy(model.config)
    with progress_bars_hidden():
        built = type(model).from_pretrained(
            None, config=config, state_dict=model.state_dict(), quantization_config=copy.deepcopy(quantization.config),
            dtype=quantization.dtype, device_map="cpu", attn_implementation=config._attn_implementation,
        )
    return built.eval()


def perturb(model: torch.nn.Module) -> None:
    """Move every parameter off its initial value by a little noise (from the current random state).

    Models initialise some weights to zeros or ones (biases, norm gains, output projections of a
    residual branch, gates): a check on such a model cannot see a missing bias or a branch that adds
    nothing. The noise is a tenth of the parameter's mean magnitude (at most 0.1).
    """
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point():
                scale = 0.1 * (parameter.detach().abs().mean().item() or 1.0)
                parameter.add_(torch.randn_like(parameter) * min(scale, 0.1))


def parameter_count(model: torch.nn.Module) -> int:
    """Number of parameters (for the docs' figures)."""
    return sum(math.prod(p.shape) for p in model.parameters())
