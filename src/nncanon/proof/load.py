"""The load-time proof: every value a model serves was checked on a twin of its own config.

`prove` builds the twin of the config on the CPU, mounts the family on it, runs `verify` and keeps
the verdict in the proof cache, keyed by what could change it: nncanon's version and code, the
transformers and torch versions, the family, the model class and the config's structural
fingerprint (the config with the twin's sizes: two checkpoints that differ only in width share a
proof). `apply_proof` then declines, on the user's model, every value the twin did not prove, and
records each served value's provenance for ``support()``.

The proof never touches the user's weights: it needs the config only, so it works for models
loaded on meta, sharded with ``device_map``, or run remotely.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from ..components.kernel import RECOMPUTED
from ..components.norms import FINAL_VALUES
from ..model_sites import MODEL_SITES
from ..mounted import MountedModel
from ..mounting import decline, decline_gradient
from ..quantization import Quantization
from ..support import COMPONENTS, LAYER_VALUES, layer_states, value_reason
from .cache import Proof, cache_key, config_digest, current_versions, read_cached, write_cached
from .checks.base import GRADIENT_VALUES
from .ladder import running_twin
from .prompts import tiny_tokenizer
from .shrink import TwinError
from .verdict import Verdict, verify

#: What ``verify=`` takes.
VERIFY_MODES = ("auto", "always", "never")


def prove(config: Any, family: Any, model_class: type, mode: str = "auto",
          quantization: Quantization | None = None) -> Proof:
    """The proof of ``config`` served by ``family`` with ``model_class``: from the cache (``mode="auto"``)
    or made now on the first twin of the ladder that runs (`nncanon.proof.ladder.running_twin`), quantized or
    cast as ``quantization`` says (`nncanon.quantization.Quantization`; ``None``: float32). Where no
    twin runs (or none can be built: `TwinError`), the proof's ``no_twin`` is the one reason every value
    is declined."""
    key = cache_key(config, family, model_class, None if quantization is None else quantization.key())
    if mode == "auto":
        cached = read_cached(key, config)
        if cached is not None:
            return cached
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a twin's matrices are small: one thread is fastest, and spares the user's
    try:
        run = running_twin(config, model_class=model_class, blocks=family.layers, quantization=quantization)
        verdict = verify(mounted_twin(run.twin.model, family))
    except TwinError as error:  # (NoTwinRuns, or a config with no causal LM or no list of blocks)
        run, verdict = None, Verdict([])
        no_twin = str(error)
    finally:
        torch.set_num_threads(threads)
    made = {"key": key, "versions": current_versions(), "family": family.name,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - start, 3)}
    if run is None:
        proof = Proof(**made, layer_map=[], twin_layers=[], verdict=verdict, no_twin=no_twin,
                      twin={"config": config_digest(config)})
    else:
        twin = run.twin
        described = run.to_dict()
        if run.step != 1:
            described["config"] = config_digest(config)
        proof = Proof(**made, layer_map=[twin.block_for(index) for index in range(len(twin.kinds))],
                      twin_layers=list(twin.stands_for), verdict=verdict,
                      changes=[[c.path, c.old, c.new, c.rule] for c in twin.changes], twin=described)
    write_cached(proof)
    return proof


def mounted_twin(module: torch.nn.Module, family: Any) -> MountedModel:
    """``family``'s surface mounted on a twin ``module``, with the proof's tokenizer: what the checks run on."""
    return MountedModel(module, family=family, tokenizer=tiny_tokenizer())




@dataclass(frozen=True)
class Provenance:
    """Where a model's served values stand: ``kind`` is ``"proved"``, ``"unproved"`` (``verify="never"``) or
    ``"declined"`` (no twin of the config runs: every value is declined, for the reason ``cause``)."""

    kind: str
    text: str
    proof: Proof | None = None
    cause: str | None = None


def apply_proof(model: Any, proof: Proof, unserved: list[frozenset[str] | None] | None = None,
                quantization: Quantization | None = None) -> Provenance:
    """Decline on ``model`` every value its proof does not prove, and the gradient of every served value
    whose gradient it does not prove; return the served values' provenance.

    A value the block does not serve anyway keeps its own reason. What the proof leaves unproved is
    worked out once per proof (`_unproved`); a load then looks up only those values on its blocks, less
    those ``unserved`` (what `nncanon.mounting.mount` returns) says the block's layout has not at all.
    """

    for index, layer in enumerate(model.layers):
        twin = proof.layer_map[index] if index < len(proof.layer_map) else None
        unproved = _unproved(proof, twin)
        absent = unserved[index] if unserved is not None and unproved else None
        if absent is not None:
            unproved = _unproved_served(proof, twin, absent)
        states = layer_states(layer) if unproved else None
        for value, reason, gradient in unproved:
            if value_reason(states, value) is not None if value != RECOMPUTED else _declined_recomputed(layer):
                continue  # (not served anyway: its own reason stays)
            if reason is None:  # no twin block stands for it: the reason names the block's kind
                reason = _not_proved(proof, None, value, type(layer._module).__name__)
            if value == RECOMPUTED and proof.no_twin is None:  # (a block without attention has no such reason)
                reason = (f"attention probabilities are not computed by this model's attention implementation, "
                          f"and recomputing them from the kernel's inputs is {reason}. Load it with "
                          f"StandardizedTransformer(..., attn_implementation=\"eager\") to read them.")
            (decline_gradient if gradient else decline)(layer, value, reason)
    family_declines = {**model._model_declines, **model._model_absent}  # (the family's own reasons stay)
    for value, reason, gradient in _unproved(proof, "model"):
        if value not in family_declines:
            (model._model_gradient_declines if gradient else model._model_declines)[value] = reason
    text = proof.describe()
    if quantization is not None:  # the twin was quantized (or cast) as the model is: say so
        text = text.replace("a twin of this config", f"{quantization.provenance()} of this config", 1)
    if proof.no_twin is not None:
        return Provenance("declined", text, proof, no_twin_reason(proof))
    return Provenance("proved", text, proof)


def no_twin_reason(proof: Proof) -> str:
    """The one reason every value of a config no twin runs is declined (``support()``'s cause)."""
    return f"not proved: the proof could not run on any twin of this config: {proof.no_twin}"


def _declined_recomputed(layer: Any) -> bool:
    """Whether block ``layer``'s recomputed probabilities are declined by its family (Falcon's ALiBi path)."""
    attention = layer.__dict__.get("self_attn")
    state = getattr(attention, "__dict__", {}).get("_nncanon") if attention is not None else None
    if state is None:
        return False

    return isinstance(state.reasons.get(RECOMPUTED), str)


def _unproved(proof: Proof, twin: int | str | None) -> list[tuple[str, str | None, bool]]:
    """What ``proof`` does not prove on twin block ``twin`` (``"model"``: the model-level values):
    ``(value, reason, gradient)``, ``gradient`` where the value is proved but its gradient is not. The
    reason is ``None`` for a block no twin block stands for (`apply_proof` names its kind). Worked out
    once per proof and block (a cached proof is one object per file, see `read_cached`)."""
    known = proof._unproved.get(twin)
    if known is None:

        known = []
        if twin == "model":
            for value in ("logits", "project_on_vocab", "skip_layers", *MODEL_SITES, *FINAL_VALUES):
                reason = _not_proved(proof, None, value, None, model_level=True)
                if reason is not None:
                    known.append((value, reason, False))
                elif value in (*MODEL_SITES, *FINAL_VALUES) and (
                        reason := _not_proved(proof, None, value, None, model_level=True, gradient=True)):
                    known.append((value, reason, True))
        for value in [] if twin == "model" else [v for v in LAYER_VALUES if v not in COMPONENTS]:
            if twin is None:
                known.append((value, None, False))
            elif (reason := _not_proved(proof, twin, value, None)) is not None:
                known.append((value, reason, False))
            elif value in GRADIENT_VALUES and (reason := _not_proved(proof, twin, value, None, gradient=True)):
                known.append((value, reason, True))
        if twin != "model":  # probabilities recomputed where the model runs sdpa

            reason = None if twin is None else _not_proved(proof, twin, RECOMPUTED, None)
            if twin is None or reason is not None:
                known.append((RECOMPUTED, reason, False))
        proof._unproved[twin] = known
    return known


def _unproved_served(proof: Proof, twin: int | None, absent: frozenset[str]) -> list[tuple[str, str | None, bool]]:
    """`_unproved` less the values in ``absent`` (a block layout's values it has not at all), once per proof."""
    known = proof._unproved.get((twin, absent))
    if known is None:
        known = proof._unproved[(twin, absent)] = [item for item in _unproved(proof, twin) if item[0] not in absent]
    return known


def _not_proved(proof: Proof, twin: int | None, value: str, block: str | None, model_level: bool = False,
                gradient: bool = False) -> str | None:
    """Why ``value`` (``gradient``: its gradient) is not proved on the block ``twin`` stands for, or ``None``."""
    if proof.no_twin is not None:
        return no_twin_reason(proof)
    if not model_level and twin is None:
        return f"not proved: a twin of this config has no block of this kind ({block})"
    layer = None if model_level else twin
    if proof.verdict.proved(layer, value, gradient):
        return None
    where = "" if model_level else f" (its block layers[{twin}] stands for layers[{proof.twin_layers[twin]}])"
    return f"not proved on a twin of this config{where}: {proof.verdict.why_not(layer, value, gradient)}"


def load_provenance(model: Any, config: Any, mode: str, unserved: list[frozenset[str] | None] | None = None,
                    quantization: Quantization | None = None) -> Provenance:
    """Prove ``model``'s values as ``mode`` says (`VERIFY_MODES`) on a twin quantized or cast as ``quantization``
    says, and apply the proof (`apply_proof`, with ``unserved``); the provenance."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify={mode!r} is not one of {', '.join(map(repr, VERIFY_MODES))}")
    if mode == "never":
        return Provenance("unproved", "unproved: loaded with verify='never' (no check ran on this config)")
    proof = prove(config, model.family, type(model._module), mode, quantization)
    if proof.no_twin is not None:
        warnings.warn(
            f"nncanon declines every value of this {config.model_type} model: the load-time proof could not run on "
            f"any twin of its config: {proof.no_twin}. model.support() says the same.", stacklevel=4,
        )
    return apply_proof(model, proof, unserved, quantization)
