"""Families nobody wrote: infer the record of an unknown architecture from a twin of its config.

`infer_family` proposes a `Family` (blocks, embedding, head, final norm, attention and its output
projection, MLP, mixer, where each contribution is read, factors named by config attributes, logit
steps); the load then proves it on a twin like any record (`nncanon.proof.load.prove`) and serves
only what the twin proves. See docs/inferred-families.md.
"""

from .declined import Declined
from .infer import InferredFamily, infer_family

__all__ = ["Declined", "InferredFamily", "infer_family"]
