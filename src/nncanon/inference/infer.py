"""`infer_family`: propose the `Family` of an architecture nobody wrote, from a twin of its config.

The twin (`nncanon.proof.ladder.running_twin`) runs once with a hook on every module (`record_run`);
the skeleton (blocks, embedding, head, final norm) and each block's roles and candidate
contributions are read from what ran (`find_skeleton`, `block_parts`); the factors are solved from
the contribution identity and named by the config attribute holding them (`solve_scales`). Among
the candidates that fit, the choice is the one verifier's (`nncanon.proof.verdict.verify` with the
``read`` and ``identity`` checks, on the twin). What is found is a proposal only: the load proves
it like any record, and declines what the twin does not prove.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import UnknownFamilyError
from ..families.base import Family
from ..proof.checks import CHECKS
from ..proof.ladder import running_twin
from ..proof.load import mounted_twin
from ..proof.shrink import TwinError
from ..proof.twin import model_class_for
from ..proof.verdict import verify
from ..served import Site
from .blocks import BlockParts, block_parts
from .declined import Declined
from .factors import CLOSE, config_attribute, logit_steps, numbers_of, solve_scales
from .layouts import layout_rule
from .operations import choose_operations
from .recording import record_run
from .render import family_source, registry_record
from .structure import find_skeleton

#: How many rounds of candidates the verifier is asked about per block kind.
ROUNDS = 4


@dataclass
class InferredFamily:
    """An inferred record, before its proof.

    Attributes:
        family: The proposed `Family` (its values are served only where the load's proof holds).
        model_class: The causal-LM class it was inferred on.
        twin_config: The twin's config (the tiny config of a registry record).
        tried: Value or role -> what was tried where nothing was found (also in ``support()``).
        seconds: How long the inference took (twin, recording, search).
    """

    family: Family
    model_class: type
    twin_config: Any
    tried: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def source(self) -> str:
        """The record as the Python a contributor pastes into ``nncanon/families/``."""

        return family_source(self)

    def registry_record(self) -> dict:
        """The ``model_registry/`` record of the type, with the twin's config as its tiny variant."""

        return registry_record(self)


def _roles(parts: BlockParts) -> list[str]:
    return [role for role in ("attention", "mixer", "mlp") if parts.candidates.get(role)]


def _fits(parts: BlockParts, config: Any) -> tuple[list[dict], str]:
    """Every choice of one candidate per role that satisfies the identity with factors named by the
    config, as Family fields, in the order to try them; and a note on the best that did not."""
    roles = _roles(parts)
    if not roles:
        return [], "the block has no candidate contribution"
    fitting, notes = [], []
    for choice in itertools.product(*(parts.candidates[role] for role in roles)):
        if any(c.value.numel() != parts.x.numel() for c in choice):
            continue
        factors, residual = solve_scales(parts.x, parts.y, [c.value for c in choice])
        labels = " + ".join(c.label for c in choice)
        if residual > CLOSE:
            notes.append((residual, f"{labels} (relative residual {residual:.1e})"))
            continue
        sites, named = {}, True
        for role, candidate, factor in zip(roles, choice, factors, strict=False):
            scale = None
            if abs(factor - 1) > CLOSE:
                scale = config_attribute(config, factor)
                if scale is None:
                    notes.append((0.0, f"{labels}: factor {factor:.6g} is no config attribute's value"))
                    named = False
                    break
            sites[role] = replace(candidate.site, scale=scale)
        if named:
            fitting.append(sites)
    notes.sort()
    return fitting, "; ".join(note for _, note in notes[:4])


def _head_counts(config: Any, width: int, head_width: int | None = None, hybrid: bool = False) -> list[str]:
    """The config attributes naming a count of output heads that splits ``width`` into heads of two or more
    (of ``head_width`` where a per-head norm shows it). Key heads do not split an output; in a hybrid,
    ``num_attention_heads`` is the softmax attention's where the mixer has a count of its own."""

    found = sorted(name for name, value in numbers_of(config).items()
                   if "head" in name and not any(w in name for w in ("dim", "size", "width", "key"))
                   and value == int(value) and value >= 1 and width % int(value) == 0 and width // int(value) >= 2
                   and (head_width is None or width // int(value) == head_width))
    if hybrid and len(found) > 1 and "num_attention_heads" in found:
        found.remove("num_attention_heads")
    return found


def _fields(parts: BlockParts, sites: dict | None, note: str, config: Any = None, hybrid: bool = False) -> dict:
    """The Family fields of a block with the chosen ``sites`` (role -> Site)."""
    fields: dict = {
        "attention": parts.attention,
        "mixer": parts.mixer,
        "mlp": parts.mlp if parts.candidates.get("mlp") else None,
        "block_extras": parts.extras or 0,
        "block_tuple": parts.extras == 0,
        "mixer_output": None,
        "mixer_head_outputs": None,
        "mixer_heads": None,
        "probabilities": None,
        "head_norm": None,
        "head_projection": None,
        **dict.fromkeys(_ROUTING),
        "shared_expert_output": None,
    }
    reasons = dict(parts.tried)
    chosen = sites or {}
    first = {role: cands[0].site for role, cands in parts.candidates.items() if cands}
    if parts.attention is not None:
        fields["attention_output"] = chosen.get("attention", first.get("attention", Site(parts.attention)))
        if parts.head_norm is not None:
            fields.update(head_outputs=Site(parts.head_norm, key="input"), head_norm=parts.head_norm,
                          head_projection=parts.projection)
        elif parts.projection is not None:
            fields["head_outputs"] = Site(parts.projection, key="input")
        else:
            fields["head_outputs"] = Site(parts.attention, key="input")
    if parts.mixer is not None:
        fields["mixer_output"] = chosen.get("mixer", first.get("mixer"))
        if parts.mixer_projection is not None:
            path, width, head_width = parts.mixer_projection
            heads = _head_counts(config, width, head_width, hybrid)
            if len(heads) == 1:
                fields["mixer_head_outputs"], fields["mixer_heads"] = Site(path, key="input"), heads[0]
            else:
                reasons["linear_attention_head_outputs"] = (
                    f"inferred: the input of {path} ({width} wide) splits into heads by "
                    + (f"several config attributes ({', '.join(heads)}): which one is ambiguous" if heads
                       else "no config attribute naming a head count")
                )
    fields["mlp_output"] = chosen.get("mlp", first.get("mlp"))
    if parts.router is not None:
        fields["expert_weights"] = Site(parts.router, index=1, flat=parts.router_flat)
        fields["expert_indices"] = Site(parts.router, index=2, flat=parts.router_flat)
        fields["shared_expert_output"] = parts.shared
    if fields["mlp"] is None and fields["mlp_output"] is None:
        reasons.setdefault("mlp", "no submodule with weights besides the token mixer returns the stream's width")
    if sites is None:
        what = "tried " + (note or "no candidate")
        for role, value in (("attention", "attention_output"), ("mixer", "linear_attention_output"),
                            ("mlp", "mlp_output")):
            if parts.candidates.get(role):
                reasons[value] = (
                    f"inferred: no candidate satisfies layer_input + contributions == layer_output on a twin; {what}"
                )
    fields["declines"] = Declined(tuple(sorted(reasons.items()))) if reasons else None
    return fields


def _family(name: str, skeleton: Any, base: dict, kinds: dict[str, dict], rule: Any, steps: tuple) -> Family:
    family = Family(
        name=f"inferred {name}",
        model_types=(name,),
        layers=skeleton.layers,
        embed_tokens=skeleton.embed_tokens,
        norm=skeleton.norm,
        lm_head=skeleton.lm_head,
        before_head=skeleton.before_head,
        embeddings=skeleton.embeddings,
        logit_steps=steps,
        residual="inferred: y = x + " + " + ".join(
            f"{role}" for role in ("attention", "mixer", "mlp") if base.get(role)
        ),
        **base,
    )
    if rule is not None:
        family = replace(family, layouts={kind: fields for kind, fields in kinds.items()}, layout_of=rule)
    return family


_ROUTING = ("router_logits", "expert_weights", "expert_indices")


def _in_every_block(model: Any, layers: str, fields: dict) -> dict:
    """``fields`` less the modules some block of ``model`` lacks (blocks of several kinds that no config
    attribute tells apart are served as one kind: what it names must exist in each)."""
    blocks = model.get_submodule(layers)

    def everywhere(path: str | None) -> bool:
        return path is None or all(_has(block, path) for block in blocks)

    fields = dict(fields)
    reasons = dict(fields["declines"].reasons) if fields.get("declines") else {}
    why = "the blocks are of several kinds, no config attribute says which is which, and not every block has {}"
    if not all(everywhere(fields[n].module) for n in _ROUTING if fields.get(n) is not None):
        fields.update(dict.fromkeys(_ROUTING), shared_expert_output=None)
    for role, sites, value in (("attention", ("attention_output", "head_outputs"), "self_attn"),
                               ("mixer", ("mixer_output",), "linear_attn"), ("mlp", ("mlp_output",), "mlp")):
        paths = [fields.get(role)] + [fields[s].module for s in sites if fields.get(s) is not None]
        if not all(everywhere(p) for p in paths):
            fields[role] = None
            for site in sites:
                fields.pop(site, None)
            if role != "attention":
                fields[sites[0]] = None
            reasons[value] = why.format(paths[0] or paths[-1])
    fields["declines"] = Declined(tuple(sorted(reasons.items()))) if reasons else None
    return fields


def _has(block: Any, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def _search(twin: Any, skeleton: Any, parts: list[BlockParts], name: str, steps: tuple) -> tuple[Family, dict]:
    """The family whose per-kind candidates the verifier accepts (``read`` and ``identity`` on the twin)."""

    fits = [_fits(p, twin.config) for p in parts]
    shapes = [p.shape() for p in parts]
    kind_of = {shape: f"kind{i}" for i, shape in enumerate(dict.fromkeys(shapes))}
    kinds = [kind_of[s] for s in shapes]
    first_block = {kind: kinds.index(kind) for kind in kind_of.values()}
    position = dict.fromkeys(first_block, 0)
    rule = layout_rule(twin.config.get_text_config(), kinds) if len(first_block) > 1 else None
    common = Counter(kinds).most_common(1)[0][0]
    tried: dict[str, str] = {}
    if len(first_block) > 1 and rule is None:
        tried["layouts"] = (f"the twin's blocks are of {len(first_block)} kinds and no config attribute says "
                            f"which block is which; every block is served as the most common kind")
    checks = [c for c in CHECKS if c.name in ("read", "identity")]
    hybrid = any(p.attention is not None for p in parts) and any(p.mixer is not None for p in parts)

    def build(fields: dict) -> Family:
        base = fields[common] if rule is not None else _in_every_block(twin.model, skeleton.layers, fields[common])
        return _family(name, skeleton, base, fields, rule, steps)

    fields: dict = {}
    for _ in range(ROUNDS):
        for kind, j in first_block.items():
            fitting, note = fits[j]
            chosen = fitting[position[kind]] if position[kind] < len(fitting) else None
            fields[kind] = _fields(parts[j], chosen, note, twin.config.get_text_config(), hybrid)
        verdict = verify(mounted_twin(twin.model, build(fields)), checks)
        failed = {kinds[r.layer] for r in verdict.failed() if r.check == "identity" and r.layer is not None}
        movable = {k for k in failed if position[k] + 1 < len(fits[first_block[k]][0])}
        if not movable:
            break
        for kind in movable:
            position[kind] += 1
    for kind, j in first_block.items():
        if fits[j][1] and not fits[j][0]:
            tried[f"contributions ({kind})"] = fits[j][1]
    layers_of = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in first_block}
    choose_operations(twin.model, build, fields, {k: parts[j] for k, j in first_block.items()}, layers_of, tried)
    return build(fields), tried


def causal_lm_class(config: Any) -> type:
    """transformers' causal-LM class for ``config`` (`UnknownFamilyError` where it has none)."""
    try:
        return model_class_for(config)
    except TwinError as error:
        raise UnknownFamilyError(
            f"nncanon cannot infer a family for model_type {getattr(config, 'model_type', None)!r}: {error}. "
            f"Pass the model itself (a built PreTrainedModel), or a folder with its code and trust_remote_code=True."
        ) from error


def infer_family(config: Any, model_class: type | None = None) -> InferredFamily:
    """Infer the `Family` of a model of ``config`` (built with ``model_class``) from a twin of it.

    Never sets ``trust_remote_code``: a custom-code model is inferred from the class the caller built
    or loaded it with.

    Raises:
        UnknownFamilyError: no list of blocks was found (the message lists what was tried), or the
            config has no causal-LM class.

    Example:
        >>> from transformers import LlamaConfig
        >>> inferred = infer_family(LlamaConfig())
        >>> inferred.family.layers, inferred.family.attention_output
        ('model.layers', Site(module='self_attn', key='output', index=0, ...))
    """
    import torch

    start = time.perf_counter()
    cls = model_class or causal_lm_class(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        try:
            twin = running_twin(config, model_class=cls).twin
        except TwinError as error:
            raise UnknownFamilyError(
                f"nncanon could not infer a family for {cls.__name__}: a twin of its config could not be built "
                f"({error}); it looked for a ModuleList with one module per layer of the config"
            ) from error
        run = record_run(twin.model)
        skeleton = find_skeleton(twin.model, run)
        count = len(twin.model.get_submodule(skeleton.layers))
        parts = [block_parts(run, f"{skeleton.layers}.{j}") for j in range(count)]
        head = run.calls[skeleton.lm_head].output
        steps, step_note = logit_steps(twin.config.get_text_config(), head, run.logits)
        name = getattr(config, "model_type", None) or type(config).__name__
        family, tried = _search(twin, skeleton, parts, name, steps)
    finally:
        torch.set_num_threads(threads)
    if step_note:
        tried["logits"] = step_note
    for p in parts[:1]:
        tried.update(p.tried)
    return InferredFamily(family, cls, twin.config, tried, round(time.perf_counter() - start, 3))
