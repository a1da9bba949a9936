"""The checks that prove each served value: two independent computations compared, with the numbers.

Every check takes a `nncanon.mounted.MountedModel` (a `StandardizedTransformer` is one) and returns
`CheckResult` records: which check, on which layer, which values it proves, whether it held, and the measured
error against its tolerance. The same checks run in the invariant suite (on every registry variant), at load
(on a twin of the user's config) and on inferred families; `nncanon.proof.verdict.verify` runs them all.

One module per kind of equality, each stating the equalities it asserts, with the reference computations in
`references` and `gradient_references`:

- `stream`: ``read`` (each value against plain hooks, bit for bit), ``identity`` (``layer_input +
  contributions == layer_output``), ``ablation`` (a contribution zeroed moves the stream by exactly it),
  ``lens`` (the lens at the last layer is the logits);
- `writes`: ``invokes`` (a write stays in its invoke), ``locality`` (in bf16, a write at one position moves
  no other);
- `heads`: ``heads`` (the heads through their slices of the output projection sum to it), ``probabilities``
  (zeroing a head's probabilities equals zeroing its output);
- `kernel`: ``kernel`` (the kernel's inputs reproduce its probabilities and output), ``recomputed`` (sdpa's
  recomputed probabilities equal eager's);
- `inside`: ``scores`` (softmax(scores) is the probabilities; a write is the same edit at the softmax),
  ``qk_norm`` (the q/k norm of the value is its output), ``gate`` (the kernel's output times the gate is the
  heads' output);
- `neurons`: ``neurons`` (activation(pre) · linear is the neurons; the neurons through the down projection's weight
  are its output; a neuron zeroed by its value is one zeroed by a plain pre-hook);
- `norms`: ``norms_run`` (first: a norm module the forward never calls is dropped, with the reason), ``norms``
  (each norm's formula, centred / scale · weight (+ bias), is its output; a pre-norm feeds its sublayer, a post-norm
  norms its output; a written scale equals a plain hook making the output the formula with it; every clean scale
  written back leaves the logits), ``norm_gradients`` (a gradient check);
- `routing`: ``routing`` (valid, distinct experts; masking one takes its output out of every token);
- `embeddings`: ``embeddings`` (the token and position embeddings and the final norm's output: reads, the family's
  formula of the embeddings into block 0, the head of the final norm's output is the logits, a write is a plain
  hook's edit), ``embedding_gradients``;
- `skips`: ``skip`` (skipped blocks pass the stream), ``resume`` (a resumed forward is the forward);
- `gradients` (`Check.gradient`: they prove ``value.grad`` apart from the value): ``gradients``,
  ``gradient_writes``; `quantized`: ``quantized_gradients`` (every quantized layer passes its gradient on).

`base` has the result record, the comparison and the bars; `CHECKS` is the one table `verify` runs.
"""

from __future__ import annotations

from .base import Check, check
from .embeddings import check_embedding_gradients, check_embeddings
from .gradients import check_gradient_writes, check_gradients
from .heads import check_heads, check_probabilities
from .inside import check_gate, check_qk_norm, check_scores
from .kernel import check_kernel, check_recomputed
from .neurons import check_neurons
from .norms import check_norm_gradients, check_norms, check_norms_run
from .quantized import check_quantized_gradients
from .routing import check_routing
from .skips import check_resume, check_skip
from .stream import check_ablation, check_identity, check_lens, check_read
from .writes import check_invokes, check_locality

#: Every check, in the order `verify` runs them: the values' checks, then the gradients'.
CHECKS: tuple[Check, ...] = (
    *(check(function) for function in (
        check_norms_run, check_read, check_identity, check_ablation, check_invokes, check_locality, check_heads,
        check_probabilities, check_kernel, check_recomputed, check_scores, check_qk_norm, check_gate, check_neurons,
        check_norms, check_routing, check_lens, check_skip, check_resume, check_embeddings,
    )),
    *(check(function, gradient=True) for function in (check_gradients, check_gradient_writes, check_norm_gradients,
                                                      check_quantized_gradients, check_embedding_gradients)),
)
