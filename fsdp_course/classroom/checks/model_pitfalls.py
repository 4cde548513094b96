"""Checkers of exercise 09: the classifier's forward path by hand, and training data with one input per sample.

The article's pitfalls 5.1 and 5.2 and its identical-samples bug (lesson 09), as code a learner writes:

- `forward_logits(model, tokens) -> logits`: a `TransformerClassifier` (no positions, `batch_first=False`) run
  layer by layer, from `(B, T)` integer token ids to `(B, classes)` float logits: embed the ids (integers into the
  `Embedding`, floats after it), scale, go to the encoder's `(T, B, d)`, pool over the sequence (dim 0), apply the
  head. Compared with `model(tokens)` on inputs where T != B, so that confusing the two dimensions shows; a result
  that differs is matched against the usual wrong paths (pooled over the batch, no transpose, no scale, a sum)
  and named.
- `make_samples(n, seq, vocab, generator) -> (inputs, labels)`: the article's data loop fixed: each of the n
  samples its own random ids in [0, vocab), drawn from `generator`, and its label `sum(ids) % 10` computed from
  its own ids (the article's loop built `torch.arange(784)` for every i: one input, one label, n times).

`F.cross_entropy` wants `(batch, classes)` logits and `(batch,)` targets (PyTorch's documentation of
`torch.nn.functional.cross_entropy`); `nn.Embedding` takes integer indices (that of `torch.nn.Embedding`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    call_learner,
    exception_hint,
    format_tensor,
    require_callable,
)
from fsdp_course.models import TransformerClassifier, TransformerConfig

__all__ = ["check_forward_logits", "check_make_samples", "checker_model", "wrong_paths"]

CASES = ((3, 5), (2, 7), (1, 6))  # (batch, seq): seq != batch, so a pooled or swapped dimension shows
SEED = 9


def checker_model() -> TransformerClassifier:
    """The checker's model: the article's kind of layer, small (vocab 17, d 16, 2 heads, 1 layer, 10 classes)."""
    torch.manual_seed(SEED)
    config = TransformerConfig.small(d_model=16, nhead=2, num_layers=1, positional=False, pre_norm=False)
    return TransformerClassifier(config).eval()


def _tokens(batch: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 100 * batch + seq)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def wrong_paths(model: TransformerClassifier, tokens: torch.Tensor) -> list[tuple[torch.Tensor, str, str]]:
    """The usual wrong forward paths on `tokens`, each as (logits it gives, problem, hint)."""
    e = model.embedding(tokens)  # (B, T, d)
    seq_first = (e * model.scale).transpose(0, 1)  # (T, B, d)
    encoded = model.encoder(seq_first)
    unswapped = model.encoder(e * model.scale)  # (B, T, d) read as (seq, batch, d)
    return [
        (model.fc(encoded.mean(1)),
         "pooled over the batch dimension (dim 1 of (seq, batch, d)): logits (seq, classes)",
         "the encoder's output is (seq, batch, d) (batch_first=False): take the mean over the sequence, dim 0, "
         "to get one vector per sample"),
        (model.fc(encoded),
         "not pooled: logits (seq, batch, classes), one row per token",
         "cross_entropy wants one row of logits per sample: take the mean over the sequence (dim 0 of the "
         "encoder's (seq, batch, d)) before the head"),
        (model.fc(encoded).transpose(0, 1),
         "not pooled: logits (batch, seq, classes), one row per token",
         "cross_entropy wants one row of logits per sample: take the mean over the sequence (dim 0 of the "
         "encoder's (seq, batch, d)) before the head"),
        (model.fc(unswapped.mean(1)),
         "no transpose: the encoder read (batch, seq, d) as (seq, batch, d), so attention mixed the samples",
         "the encoder has batch_first=False: transpose the embeddings to (seq, batch, d) before it "
         "(x.transpose(0, 1)), then pool over dim 0"),
        (model.fc(unswapped.mean(0)),
         "no transpose: the encoder read (batch, seq, d) as (seq, batch, d), and the mean over dim 0 then "
         "pooled the batch: logits (seq, classes)",
         "the encoder has batch_first=False: transpose the embeddings to (seq, batch, d) before it "
         "(x.transpose(0, 1)), then pool over dim 0"),
        (model.fc(model.encoder(e.transpose(0, 1)).mean(0)),
         "the embeddings were not multiplied by model.scale",
         "the article scales the embeddings by sqrt(d_model) before the encoder: x = model.embedding(tokens) * "
         "model.scale"),
        (model.fc(encoded.sum(0)),
         "a sum over the sequence, not its mean",
         "pool with .mean(dim=0), as the article's x.mean(0): a sum grows with the sequence length"),
    ]


def _forward_hint(exc: BaseException) -> str:
    text = str(exc)
    if "'indices'" in text and "Long, Int" in text:
        return ("token ids cast to float before the embedding: an Embedding looks rows up, so give it the integer "
                "ids as they are (no .float() on tokens)")
    if "mat1 and mat2 must have the same dtype" in text or "same dtype" in text:
        return ("a long (integer) tensor reached a Linear or the encoder: only the embedding takes the ids; "
                "what comes out of it is float, keep it float (no .long())")
    if "shape" in text and ("batch_size" in text or "TransformerEncoder" in text or "embed_dim" in text):
        return "follow the shapes: (B, T) ids -> (B, T, d) embeddings -> (T, B, d) for the encoder"
    return exception_hint(exc)


def check_forward_logits(fn: Callable[[TransformerClassifier, torch.Tensor], Any]) -> None:
    """Check `fn(model, tokens) -> logits`: `(B, T)` long ids to `(B, classes)` float logits, layer by layer.

    Compared with `model(tokens)` (the course's forward) for (batch, seq) in `CASES`; the tokens must come back
    unchanged (still integers) and `model(...)` itself must not be called.
    """
    check = "check_forward_logits"
    name = require_callable(check, fn, "forward_logits")
    model = checker_model()
    called_model = []
    handle = model.register_forward_pre_hook(lambda module, args: called_model.append(True))
    try:
        for batch, seq in CASES:
            tokens = _tokens(batch, seq, model.config.vocab_size)
            where = f"tokens of shape (batch {batch}, seq {seq}), {model.config.num_classes} classes"
            with torch.no_grad():
                expected = model(tokens)
            called_model.clear()
            given = tokens.clone()
            with torch.no_grad():
                got = call_learner(check, name, fn, model, given, where=where, hint_for=_forward_hint)
            if called_model:
                CheckFailure(check, where, f"{name} called model(tokens)",
                             "write the path with the model's layers (model.embedding, model.encoder, model.fc): "
                             "model(tokens) is what the checker compares with").fail()
            if given.dtype != tokens.dtype or not torch.equal(given, tokens):
                changed = f"turned them into {given.dtype}" if given.dtype != tokens.dtype else "changed their values"
                CheckFailure(check, where, f"{name} changed the tokens it was given: {changed}",
                             "leave the ids as they are: an Embedding takes integer ids; cast nothing in place").fail()
            _compare_logits(check, where, model, tokens, expected, got)
    finally:
        handle.remove()
    print(f"All tests in {check} passed (batch, seq = {', '.join(f'({b}, {t})' for b, t in CASES)})")
    print("  long ids into the embedding, float from there on, (seq, batch, d) into the encoder, the mean over the "
          "sequence: (batch, classes) logits equal to the model's own forward, ready for F.cross_entropy")


def _compare_logits(check: str, where: str, model: TransformerClassifier, tokens: torch.Tensor,
                    expected: torch.Tensor, got: Any) -> None:
    if not isinstance(got, torch.Tensor):
        CheckFailure(check, where, f"returned {type(got).__name__}, not the logits",
                     "return the head's output, model.fc(pooled)").fail()
    got = got.detach()
    batch, seq = tokens.shape
    details = [f"expected {format_tensor(expected, 8)}", f"got      {format_tensor(got, 8)}"]
    if got.dtype != expected.dtype:
        CheckFailure(check, where, f"logits are {got.dtype}, expected {expected.dtype}",
                     "the logits are the float output of model.fc: cast nothing to long", details).fail()
    if tuple(got.shape) == tuple(expected.shape) and torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        return
    with torch.no_grad():
        for logits, problem, hint in wrong_paths(model, tokens):
            if logits.shape == got.shape and torch.allclose(got, logits, rtol=1e-4, atol=1e-5):
                CheckFailure(check, where, problem, hint, details).fail()
    if tuple(got.shape) != tuple(expected.shape):
        problem = f"logits of shape {tuple(got.shape)}, expected (batch, classes) = {tuple(expected.shape)}"
        hint = ("F.cross_entropy wants one row of class scores per sample: (seq, batch, d) from the encoder, the mean "
                "over dim 0, then model.fc")
        if seq in got.shape[:1] and batch not in got.shape:
            hint = "the first dimension counts tokens, not samples: pool over the sequence (dim 0 of (seq, batch, d))"
        CheckFailure(check, where, problem, hint, details).fail()
    CheckFailure(check, where, "the logits differ from the model's forward", "embedding * model.scale, transpose "
                 "to (seq, batch, d), model.encoder, .mean(dim=0), model.fc: compare each step's shape", details).fail()


def check_make_samples(fn: Callable[[int, int, int, torch.Generator], Any]) -> None:
    """Check `fn(n, seq, vocab, generator) -> (inputs, labels)`: n different random samples, each labelled by its ids.

    inputs: `(n, seq)` long ids in [0, vocab), drawn from `generator` (the same seed gives the same data, another
    seed other data); labels: `(n,)` long, `inputs.sum(1) % 10`. Then one step of `F.cross_entropy` on a model's
    logits for them must run.
    """
    check = "check_make_samples"
    name = require_callable(check, fn, "make_samples")
    n, seq, vocab = 32, 6, 17
    where = f"n={n}, seq={seq}, vocab={vocab}"
    out = call_learner(check, name, fn, n, seq, vocab, torch.Generator().manual_seed(1), where=where)
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        CheckFailure(check, where, f"returned {type(out).__name__}, not a pair of tensors",
                     "return inputs, labels").fail()
    inputs, labels = out
    if tuple(inputs.shape) != (n, seq):
        CheckFailure(check, where, f"inputs of shape {tuple(inputs.shape)}, expected (n, seq) = {(n, seq)}",
                     "one row of seq token ids per sample: torch.randint(0, vocab, (n, seq), generator=...)").fail()
    if inputs.dtype != torch.long:
        CheckFailure(check, where, f"inputs are {inputs.dtype}: token ids must be integers (torch.long)",
                     "an Embedding takes integer ids: draw them with torch.randint, and cast nothing to float").fail()
    if int(inputs.min()) < 0 or int(inputs.max()) >= vocab:
        CheckFailure(check, where, f"ids from {int(inputs.min())} to {int(inputs.max())}, outside [0, {vocab})",
                     "an Embedding(vocab, d) has rows 0 .. vocab - 1: torch.randint(0, vocab, ...)").fail()
    if len(inputs.unique(dim=0)) == 1:
        CheckFailure(check, where, f"every sample has the same input ({n} copies of one row)",
                     "the article's bug: x did not depend on i; draw each sample's ids anew, e.g. all at once "
                     "with torch.randint(0, vocab, (n, seq), generator=generator)",
                     [f"inputs[0] {format_tensor(inputs[0])}"]).fail()
    expected = inputs.sum(1) % 10
    if tuple(labels.shape) != (n,):
        CheckFailure(check, where, f"labels of shape {tuple(labels.shape)}, expected (n,) = {(n,)}",
                     "one class index per sample, a 1-D tensor: F.cross_entropy wants targets of shape (batch,)"
                     ).fail()
    if labels.dtype != torch.long:
        CheckFailure(check, where, f"labels are {labels.dtype}, expected torch.long class indices",
                     "F.cross_entropy takes class indices as integers: inputs.sum(1) % 10 stays long").fail()
    if not torch.equal(labels, expected):
        bad = int((labels != expected).nonzero()[0])
        problem = f"label {bad} is {int(labels[bad])}, expected sum(inputs[{bad}]) % 10 = {int(expected[bad])}"
        if (labels == labels[0]).all():
            problem = f"every sample has the same label ({int(labels[0])}), not its own sum % 10"
        CheckFailure(check, where, problem, "label each sample by its own ids: inputs.sum(dim=1) % 10",
                     [f"expected {format_tensor(expected)}", f"got      {format_tensor(labels)}"]).fail()
    again = call_learner(check, name, fn, n, seq, vocab, torch.Generator().manual_seed(1), where=where)
    other = call_learner(check, name, fn, n, seq, vocab, torch.Generator().manual_seed(2), where=where)
    if not torch.equal(again[0], inputs) or torch.equal(other[0], inputs):
        CheckFailure(check, where, "the same generator seed gave other data, or another seed the same data",
                     "draw the ids from the generator you are given: torch.randint(..., generator=generator)").fail()
    model = checker_model()
    loss = F.cross_entropy(model(inputs), labels)  # the pitfall 5.2 pairing: (n, classes) logits, (n,) targets
    assert torch.isfinite(loss)
    print(f"All tests in {check} passed (n={n}, seq={seq}, vocab={vocab}; seeds 1 and 2)")
    print(f"  {len(inputs.unique(dim=0))} distinct inputs of {n}, {len(labels.unique())} distinct labels, each "
          f"sum % 10 of its own ids; F.cross_entropy takes them with the model's (n, classes) logits")
