"""The dictionary feature dashboard: a feature's top activating contexts with every token shaded by its
activation, the histogram of its activations, and the logits its decoder row promotes and suppresses.

The logits are the decoder row through the model's final norm and head, as a lens reads a stream state:
``project_on_vocab(W_dec[f]) - project_on_vocab(0)`` (the head's and norm's biases removed), so on every family the
family's own final norm, head and logit post-processing apply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import InvalidInput
from .page import Page, render, rounded


def feature_activations(model: Any, attached: Any, texts: Sequence[str], feature: int, batch_size: int = 8
                        ) -> tuple[list[list[str]], list[torch.Tensor]]:
    """Each text's tokens (decoded alone) and ``feature``'s activation at each ``[len(tokens)]``, in batches."""
    tokenizer = model.tokenizer
    tokens: list[list[str]] = []
    values: list[torch.Tensor] = []
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start:start + batch_size])
        encoded = tokenizer(chunk, return_tensors="pt", padding=True)
        mask = encoded["attention_mask"].bool()
        saved: list = []
        with torch.no_grad(), model.trace(chunk):
            saved.append(attached.features[..., feature].save())
        acts = saved[0].float().cpu()
        for row in range(len(chunk)):
            ids = encoded["input_ids"][row][mask[row]].tolist()
            tokens.append([tokenizer.decode([i]) for i in ids])
            values.append(acts[row][mask[row]])
    return tokens, values


def decoder_logits(model: Any, direction: torch.Tensor) -> torch.Tensor | None:
    """``[vocab]``: ``direction`` (a residual-stream direction ``[hidden]``) through the final norm and head, less
    the head at zero; ``None`` where ``direction`` is not as wide as the stream."""
    hidden = model.config.get_text_config().hidden_size
    if direction.shape[-1] != hidden:
        return None
    dtype = next(model._module.parameters()).dtype
    device = next(model._module.parameters()).device
    with torch.no_grad():
        row = direction.detach().to(device=device, dtype=dtype)[None]
        out = model.project_on_vocab(row) - model.project_on_vocab(torch.zeros_like(row))
    return out[0].float().cpu()


def feature_data(tokens: Sequence[Sequence[str]], activations: Sequence[Any], feature: int, k: int = 10,
                 logits: torch.Tensor | None = None, vocab: Sequence[str] | Callable[[int], str] | None = None,
                 n_logits: int = 10,
                 before: int = 24, after: int = 6, bins: int = 30) -> dict:
    """The page's data from each text's ``tokens`` and ``feature``'s ``activations`` on them.

    ``contexts``: the ``k`` largest activations, each ``{"tokens", "acts", "at"}`` (``before`` tokens, the token,
    ``after`` tokens; ``at`` the token's index); ``histogram``: ``counts`` and ``edges`` of the positive
    activations; ``promoted`` / ``suppressed``: ``[token, logit]`` of ``logits`` ``[vocab]`` (``vocab``: the token
    strings, or a function from a token id to its string, called for the shown tokens only).

    Raises:
        InvalidInput: a text whose activations are not one per token.
    """
    flat: list[tuple[float, int, int]] = []
    nan = 0
    rows = []
    for index, (text_tokens, values) in enumerate(zip(tokens, activations, strict=True)):
        values = torch.as_tensor(values, dtype=torch.float32).flatten()
        if len(values) != len(text_tokens):
            raise InvalidInput(f"text {index} has {len(text_tokens)} tokens but {len(values)} activations: one "
                               "activation per token (from another tokenizer or model?)")
        nan += int(torch.isnan(values).sum())
        rows.append(values)
        flat.extend((float(v), index, pos) for pos, v in enumerate(values.tolist()) if math.isfinite(v) and v > 0)
    flat.sort(key=lambda item: -item[0])
    contexts = []
    for value, index, pos in flat[:k]:
        start = max(0, pos - before)
        window = slice(start, pos + 1 + after)
        contexts.append({"value": rounded(value), "at": pos - start, "tokens": list(tokens[index][window]),
                         "acts": [rounded(v, 3) for v in rows[index][window].tolist()]})
    positive = torch.tensor([item[0] for item in flat]) if flat else torch.zeros(0)
    if len(positive):
        counts = torch.histc(positive, bins=bins, min=0.0, max=float(positive.max()))
        edges = torch.linspace(0.0, float(positive.max()), bins + 1)
        histogram = {"counts": counts.long().tolist(), "edges": [rounded(e, 3) for e in edges.tolist()]}
    else:
        histogram = {"counts": [], "edges": []}
    total = sum(len(row) for row in rows)
    data: dict[str, Any] = {"feature": feature, "contexts": contexts, "histogram": histogram, "nan": nan,
                            "density": rounded(len(flat) / total if total else 0.0), "tokens_seen": total}
    if logits is not None:
        if vocab is None or (not callable(vocab) and len(vocab) != len(logits)):
            raise InvalidInput(f"{len(logits)} logits but {None if vocab is None else len(vocab)} vocabulary strings")
        decode = vocab if callable(vocab) else vocab.__getitem__
        finite = torch.nan_to_num(logits.float(), nan=0.0)
        count = min(n_logits, len(finite))
        top, low = finite.topk(count), (-finite).topk(count)
        data["promoted"] = [[decode(i), rounded(v)] for v, i in zip(top.values.tolist(), top.indices.tolist(),
                                                                     strict=True)]
        data["suppressed"] = [[decode(i), rounded(-v)] for v, i in zip(low.values.tolist(), low.indices.tolist(),
                                                                        strict=True)]
    return data


def feature_page(model: Any, attached: Any, texts: Sequence[str], feature: int, k: int = 10, n_logits: int = 10,
                 batch_size: int = 8, title: str | None = None) -> Page:
    """The dashboard of ``feature`` of an attached dictionary (``with nncanon.sae.attach(model, d) as attached``)
    over ``texts``: one pass over the texts in batches (`feature_activations`), the decoder row's logits
    (`decoder_logits`).

    Raises:
        InvalidInput: no texts, an empty text, a feature outside the dictionary.
    """
    if isinstance(texts, str) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise InvalidInput("feature_page takes a non-empty list of non-empty texts (a list, not one string)")
    dictionary = attached.dictionary
    if not 0 <= int(feature) < dictionary.d_sae:
        raise InvalidInput(f"feature {feature} is not one of the dictionary's {dictionary.d_sae} features")
    tokens, values = feature_activations(model, attached, texts, int(feature), batch_size)
    logits = decoder_logits(model, dictionary.W_dec[int(feature)])
    data = feature_data(tokens, values, int(feature), k, logits, lambda i: model.tokenizer.decode([i]), n_logits)
    notes = []
    if logits is None:
        notes.append(f"The decoder writes a {dictionary.W_dec.shape[-1]}-wide space, not the residual stream: "
                     "no logits are shown.")
    if not data["contexts"]:
        notes.append(f"Feature {feature} is never active on these {len(texts)} texts: no context to show.")
    if data["nan"]:
        notes.append(f"{data['nan']} activations are NaN (left out of the contexts and the histogram).")
    name = title if title is not None else f"Feature {feature} of {getattr(dictionary, 'name', None) or 'dictionary'}"
    return render("feature", name, data, notes)
