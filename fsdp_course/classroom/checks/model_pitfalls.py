"""Checkers of exercise 09: the classifier's forward path by hand, and training data with one input per sample.

Cites the shapes PyTorch's F.cross_entropy documents.
Design notes: docs/CLASSROOM.md, "Checkers", `model_pitfalls.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    call_learner,
    exception_hint,
    format_tensor,
    require_callable,
    say_passed,
)
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.models import TransformerClassifier, TransformerConfig

__all__ = ["check_forward_logits", "check_make_samples", "checker_model", "wrong_paths"]

CASES = ((3, 5), (2, 7), (1, 6))  # (batch, seq): seq != batch, so a pooled or swapped dimension shows
SEED = 9

T = catalogue("model_pitfalls")  # fsdp_course/i18n/catalogues/model_pitfalls.yml


def checker_model() -> TransformerClassifier:
    """The checker's model: the article's kind of layer, small (vocab 17, d 16, 2 heads, 1 layer, 10 classes)."""
    torch.manual_seed(SEED)
    config = TransformerConfig.small(d_model=16, nhead=2, num_layers=1, positional=False, pre_norm=False)
    return TransformerClassifier(config).eval()


def _tokens(batch: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 100 * batch + seq)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def wrong_paths(model: TransformerClassifier, tokens: torch.Tensor) -> list[tuple[torch.Tensor, Message, Message]]:
    """The usual wrong forward paths on `tokens`, each as (logits it gives, problem, hint)."""
    e = model.embedding(tokens)  # (B, T, d)
    seq_first = (e * model.scale).transpose(0, 1)  # (T, B, d)
    encoded = model.encoder(seq_first)
    unswapped = model.encoder(e * model.scale)  # (B, T, d) read as (seq, batch, d)
    return [
        (model.fc(encoded.mean(1)), T("pooled_batch"), T("mean_over_seq")),
        (model.fc(encoded), T("not_pooled_seq"), T("row_per_sample")),
        (model.fc(encoded).transpose(0, 1), T("not_pooled_batch"), T("row_per_sample")),
        (model.fc(unswapped.mean(1)), T("no_transpose"), T("transpose_first")),
        (model.fc(unswapped.mean(0)), T("no_transpose_pooled"), T("transpose_first")),
        (model.fc(model.encoder(e.transpose(0, 1)).mean(0)), T("not_scaled"), T("scale_embeddings")),
        (model.fc(encoded.sum(0)), T("summed"), T("pool_mean")),
    ]


def _forward_hint(exc: BaseException) -> Message:
    text = str(exc)
    if "'indices'" in text and "Long, Int" in text:
        return T("ids_float")
    if "mat1 and mat2 must have the same dtype" in text or "same dtype" in text:
        return T("long_reached")
    if "shape" in text and ("batch_size" in text or "TransformerEncoder" in text or "embed_dim" in text):
        return T("follow_shapes")
    return exception_hint(exc)


@torch.no_grad()
def check_forward_logits(fn: Callable[[TransformerClassifier, torch.Tensor], Any]) -> None:
    """Check `fn(model, tokens) -> logits`: `(B, T)` long ids to `(B, classes)` float logits, layer by layer.

    Compared with `model(tokens)` (the course's forward) for (batch, seq) in `CASES`; the tokens must come back
    unchanged (still integers) and `model(...)` itself must not be called.
    """
    check = "check_forward_logits"
    name = require_callable(check, fn, "forward_logits")
    model = checker_model()
    called_model = []
    model.register_forward_pre_hook(lambda module, args: called_model.append(True))  # the model is this call's own
    for batch, seq in CASES:
        tokens = _tokens(batch, seq, model.config.vocab_size)
        where = f"tokens of shape (batch {batch}, seq {seq}), {model.config.num_classes} classes"
        expected = model(tokens)
        called_model.clear()
        given = tokens.clone()
        got = call_learner(check, name, fn, model, given, where=where, hint_for=_forward_hint)
        if called_model:
            CheckFailure(check, where, T("called_model", name=name), T("use_layers")).fail()
        if given.dtype != tokens.dtype or not torch.equal(given, tokens):
            changed = T("turned_into", dtype=given.dtype) if given.dtype != tokens.dtype else T("changed_values")
            CheckFailure(check, where, T("changed_tokens", name=name, changed=changed), T("leave_ids")).fail()
        _compare_logits(check, where, model, tokens, expected, got)
    say_passed(check, T("logits_cases", cases=", ".join(f"({b}, {t})" for b, t in CASES)), T("logits_passed"))


def _compare_logits(check: str, where: str, model: TransformerClassifier, tokens: torch.Tensor,
                    expected: torch.Tensor, got: Any) -> None:
    if not isinstance(got, torch.Tensor):
        CheckFailure(check, where, T("not_logits", kind=type(got).__name__), T("return_head")).fail()
    got = got.detach()
    batch, seq = tokens.shape
    details = [f"expected {format_tensor(expected, 8)}", f"got      {format_tensor(got, 8)}"]
    if got.dtype != expected.dtype:
        CheckFailure(check, where, T("logits_dtype", got=got.dtype, expected=expected.dtype), T("float_logits"),
                     details).fail()
    if tuple(got.shape) == tuple(expected.shape) and torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        return
    for logits, problem, hint in wrong_paths(model, tokens):  # (under check_forward_logits's no_grad)
        if logits.shape == got.shape and torch.allclose(got, logits, rtol=1e-4, atol=1e-5):
            CheckFailure(check, where, problem, hint, details).fail()
    if tuple(got.shape) != tuple(expected.shape):
        problem = T("logits_shape", got=tuple(got.shape), expected=tuple(expected.shape))
        hint = T("class_scores")
        if seq in got.shape[:1] and batch not in got.shape:
            hint = T("counts_tokens")
        CheckFailure(check, where, problem, hint, details).fail()
    CheckFailure(check, where, T("logits_differ"), T("each_step"), details).fail()


def check_make_samples(fn: Callable[[int, int, int, torch.Generator], Any]) -> None:
    """Check `fn(n, seq, vocab, generator) -> (inputs, labels)`: n different random samples, each labelled by its ids.

    inputs: `(n, seq)` long ids in [0, vocab), drawn from `generator` (the same seed gives the same data, another
    seed other data); labels: `(n,)` long, `inputs.sum(1) % 10` (what `F.cross_entropy` takes with `(n, classes)`
    logits: pitfall 5.2).
    """
    check = "check_make_samples"
    name = require_callable(check, fn, "make_samples")
    n, seq, vocab = 32, 6, 17
    where = f"n={n}, seq={seq}, vocab={vocab}"
    out = call_learner(check, name, fn, n, seq, vocab, torch.Generator().manual_seed(1), where=where)
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        CheckFailure(check, where, T("not_pair", kind=type(out).__name__), T("return_pair")).fail()
    inputs, labels = out
    if tuple(inputs.shape) != (n, seq):
        CheckFailure(check, where, T("inputs_shape", got=tuple(inputs.shape), expected=(n, seq)), T("row_of_ids")
                     ).fail()
    if inputs.dtype != torch.long:
        CheckFailure(check, where, T("inputs_dtype", dtype=inputs.dtype), T("draw_integers")).fail()
    if int(inputs.min()) < 0 or int(inputs.max()) >= vocab:
        CheckFailure(check, where, T("ids_range", low=int(inputs.min()), high=int(inputs.max()), vocab=vocab),
                     T("embedding_rows")).fail()
    if len(inputs.unique(dim=0)) == 1:
        CheckFailure(check, where, T("same_input", n=n), T("x_without_i"),
                     [f"inputs[0] {format_tensor(inputs[0])}"]).fail()
    expected = inputs.sum(1) % 10
    if tuple(labels.shape) != (n,):
        CheckFailure(check, where, T("labels_shape", got=tuple(labels.shape), expected=(n,)), T("one_class")).fail()
    if labels.dtype != torch.long:
        CheckFailure(check, where, T("labels_dtype", dtype=labels.dtype), T("long_labels")).fail()
    if not torch.equal(labels, expected):
        bad = int((labels != expected).nonzero()[0])
        problem = T("wrong_label", i=bad, got=int(labels[bad]), expected=int(expected[bad]))
        if (labels == labels[0]).all():
            problem = T("same_label", label=int(labels[0]))
        CheckFailure(check, where, problem, T("own_ids"),
                     [f"expected {format_tensor(expected)}", f"got      {format_tensor(labels)}"]).fail()
    again = call_learner(check, name, fn, n, seq, vocab, torch.Generator().manual_seed(1), where=where)
    other = call_learner(check, name, fn, n, seq, vocab, torch.Generator().manual_seed(2), where=where)
    if not torch.equal(again[0], inputs) or torch.equal(other[0], inputs):
        CheckFailure(check, where, T("seeds"), T("from_generator")).fail()
    say_passed(check, T("samples_cases", n=n, seq=seq, vocab=vocab),
               T("samples_passed", distinct=len(inputs.unique(dim=0)), n=n, labels=len(labels.unique())))
