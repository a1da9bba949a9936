"""The standard evaluation of a dictionary: how well it reconstructs its point, how sparse it is, what it costs the
model when spliced in. SAELens's headline metrics (``sae_lens.evals``), with the same definitions:

- ``mse``: ``‖x - x̂‖²`` per token (summed over the width), averaged over tokens;
- ``explained_variance``: ``1 - E‖x - x̂‖² / (E‖x‖² - ‖E x‖²)``, sums in float64;
- ``cossim``: the cosine of ``x`` and ``x̂``, averaged over tokens;
- ``l0``: features not zero per token, averaged; ``l1``: their absolute sum, averaged;
- ``ce_loss_clean``, ``ce_loss_with_reconstruction``, ``ce_loss_zero_ablation``: the model's next-token loss
  clean, with the point's value replaced by the reconstruction, and with it zeroed; ``ce_loss_score`` =
  ``(zero - reconstruction) / (zero - clean)`` (1: the reconstruction loses nothing);
- ``kl_div_with_reconstruction``, ``kl_div_zero_ablation``: ``KL(clean ‖ run)`` of the next-token distributions.

Padding is never counted; every token of every text is (the first included: drop it from the texts' tokens, or
compare with a SAELens evaluation that excludes it, if that matters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..errors import InvalidInput
from .dictionary import Dictionary
from .sites import value_at
from .splice import AttachedDictionary, attach
from .tools import positive, progress_bar


@dataclass
class Evaluation:
    """The result of `evaluate` (see the module's docstring for each metric)."""

    mse: float
    explained_variance: float
    cossim: float
    l0: float
    l1: float
    ce_loss_clean: float
    ce_loss_with_reconstruction: float
    ce_loss_zero_ablation: float
    ce_loss_score: float
    kl_div_with_reconstruction: float
    kl_div_zero_ablation: float
    tokens: int

    def to_dict(self) -> dict[str, float]:
        """The metrics as a dict."""
        return asdict(self)

    def __str__(self) -> str:
        return "\n".join(f"{name:28s} {value:.6g}" for name, value in self.to_dict().items())


def _token_losses(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token next-token losses ``[n]`` and log-probabilities ``[n, V]`` of the valid positions."""
    valid = (mask[:, 1:] & mask[:, :-1]).reshape(-1)
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1).reshape(-1, logits.shape[-1])[valid]
    targets = ids[:, 1:].reshape(-1)[valid]
    return -log_probs.gather(1, targets[:, None])[:, 0], log_probs


def evaluate(
    model: Any,
    dictionary: Dictionary | AttachedDictionary,
    texts: Sequence[str],
    hook_name: str | None = None,
    batch_size: int = 8,
    progress: bool | None = None,
) -> Evaluation:
    """The standard evaluation of ``dictionary`` at its point over ``texts`` (see `Evaluation`).

    Three forwards per batch of ``batch_size`` texts: clean (the point's value and the logits), with the value
    replaced by the reconstruction, with the value zeroed (a transcoder's output point). No gradients.

    Args:
        model: A `StandardizedTransformer`.
        dictionary: A `Dictionary` (attached at ``hook_name`` or its own for the evaluation, and detached after), or an
            `AttachedDictionary` (evaluated where it is attached; it is left attached, and should not be edited
            meanwhile: its splice would add to the replacement).
        texts: The texts (each a prompt; batched left-padded).
        hook_name: Where a `Dictionary` reads (default: its ``hook_name``).
        progress: A progress bar over the texts (default: where there is more than one batch).
    """
    if isinstance(texts, str):
        raise InvalidInput("evaluate takes a list of texts, not one string: pass [text]")
    texts = list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidInput("evaluate takes a non-empty list of texts")
    positive("evaluate", "batch_size", batch_size)
    owned = not isinstance(dictionary, AttachedDictionary)
    if not owned:
        dictionary._refuse_detached("features")
    if not owned and not dictionary.error_term:
        raise InvalidInput(f"{dictionary.label} is attached with error_term=False: it replaces the value in every "
                           "trace, so there is no clean run to compare with. Evaluate its Dictionary (with hook_name=) "
                           "or detach it first")
    attached = attach(model, dictionary, hook_name, name="evaluation") if owned else dictionary
    try:
        return _evaluate(model, attached, texts, batch_size, progress)
    finally:
        if owned:
            attached.detach()


def _evaluate(model: Any, attached: AttachedDictionary, texts: list[str], batch_size: int,
              progress: bool | None = None) -> Evaluation:
    sums = {name: 0.0 for name in ("mse", "cossim", "l0", "l1", "ce_clean", "ce_recon", "ce_zero", "kl_recon",
                                   "kl_zero", "norm", "residual")}
    total_x: torch.Tensor | None = None
    tokens = losses = 0
    dictionary = attached.dictionary
    point, point_out = attached.point, attached.point_out
    bar = progress_bar(len(texts), "evaluating", progress, batch_size)
    for start in range(0, len(texts), batch_size):
        chunk = texts[start:start + batch_size]
        if bar is not None:
            bar.update(len(chunk))
        encoded = model.tokenizer(chunk, return_tensors="pt", padding=True)
        ids, mask = encoded["input_ids"], encoded["attention_mask"].bool()
        saved: list = []
        with torch.no_grad(), model.trace(chunk):
            saved.append(value_at(model, point).save())
            if point_out != point:
                saved.append(value_at(model, point_out).save())
            saved.append(model.logits.save())
        served, logits = saved[0], saved[-1]
        served_out = saved[1] if point_out != point else served
        # in the dictionary's space: the processing it was trained under applied (`nncanon.sae.processing`)
        x, out = attached.reading.read(served), attached.writing.read(served_out)
        local = dictionary.to(x.device)
        with torch.no_grad():
            features, state = local.encode_with_state(x)
            recon = local.decode(features, state, x).reshape(out.shape).to(out.dtype)
        valid = mask.to(x.device)
        flat_out = out.flatten(2)[valid].double()
        flat_recon = recon.flatten(2)[valid].double()
        flat_features = features[valid]
        residual = (flat_out - flat_recon).pow(2).sum(-1)
        sums["mse"] += float(residual.sum())
        sums["residual"] += float(residual.sum())
        sums["norm"] += float(flat_out.pow(2).sum())
        total_x = flat_out.sum(0) if total_x is None else total_x + flat_out.sum(0)
        sums["cossim"] += float(torch.nn.functional.cosine_similarity(flat_out, flat_recon, dim=-1).sum())
        sums["l0"] += float((flat_features != 0).sum())
        sums["l1"] += float(flat_features.abs().sum())
        tokens += int(valid.sum())
        runs = []
        for replacement in (recon, torch.zeros_like(recon)):
            replacement = attached.writing.back(replacement, served_out)  # the processing undone
            kept: list = []
            with torch.no_grad(), model.trace(chunk):
                value = value_at(model, point_out)
                value[:] = replacement
                kept.append(model.logits.save())
            runs.append(kept[0])
        clean_loss, clean_logp = _token_losses(logits.cpu(), ids, mask)
        losses += clean_loss.numel()
        sums["ce_clean"] += float(clean_loss.sum())
        for key, run in zip(("recon", "zero"), runs, strict=True):
            loss, logp = _token_losses(run.cpu(), ids, mask)
            sums[f"ce_{key}"] += float(loss.sum())
            sums[f"kl_{key}"] += float((clean_logp.exp() * (clean_logp - logp)).sum())
    variance = sums["norm"] / tokens - float((total_x / tokens).pow(2).sum())
    mse = sums["mse"] / tokens
    clean, recon_loss, zero = (sums[k] / max(losses, 1) for k in ("ce_clean", "ce_recon", "ce_zero"))
    if bar is not None:
        bar.close()
    return Evaluation(
        mse=mse,
        explained_variance=(1.0 if mse < 1e-10 else 0.0) if variance < 1e-10 else 1.0 - mse / variance,
        cossim=sums["cossim"] / tokens, l0=sums["l0"] / tokens, l1=sums["l1"] / tokens,
        ce_loss_clean=clean, ce_loss_with_reconstruction=recon_loss, ce_loss_zero_ablation=zero,
        ce_loss_score=(zero - recon_loss) / (zero - clean) if zero != clean else float("nan"),
        kl_div_with_reconstruction=sums["kl_recon"] / max(losses, 1),
        kl_div_zero_ablation=sums["kl_zero"] / max(losses, 1), tokens=tokens)
