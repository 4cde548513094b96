"""The checkers of exercise 09 (the forward path from ids to logits, and one input per sample) pass the reference
solutions and fail planted mistakes with the diagnosis that names them: each planted function is the reference with
one thing wrong, as a learner would get it (the article's pitfalls 5.1 and 5.2 and its identical samples)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from reference_solutions import fails, load

from fsdp_course.classroom.checks import check_forward_logits, check_make_samples

PITFALLS = load("09_model_pitfalls")


def pooled_over_batch(model, tokens):  # pitfall 5.2: the mean over dim 1 of (seq, batch, d)
    return model.fc(model.encoder((model.embedding(tokens) * model.scale).transpose(0, 1)).mean(dim=1))


def ids_cast_to_float(model, tokens):  # pitfall 5.1 the other way round: floats into the embedding
    x = model.embedding(tokens.float()) * model.scale
    return model.fc(model.encoder(x.transpose(0, 1)).mean(dim=0))


def embedding_cast_to_long(model, tokens):  # pitfall 5.1: an integer tensor reaches the encoder's Linear layers
    x = (model.embedding(tokens) * model.scale).long().transpose(0, 1)
    return model.fc(model.encoder(x).mean(dim=0))


def no_transpose(model, tokens):  # (batch, seq, d) given to a batch_first=False encoder, pooled over "dim 1"
    return model.fc(model.encoder(model.embedding(tokens) * model.scale).mean(dim=1))


def not_pooled(model, tokens):
    return model.fc(model.encoder((model.embedding(tokens) * model.scale).transpose(0, 1)))


def no_scale(model, tokens):
    return model.fc(model.encoder(model.embedding(tokens).transpose(0, 1)).mean(dim=0))


def summed(model, tokens):
    return model.fc(model.encoder((model.embedding(tokens) * model.scale).transpose(0, 1)).sum(dim=0))


def calls_the_model(model, tokens):
    return model(tokens)


def returns_nothing(model, tokens):
    PITFALLS["forward_logits"](model, tokens)


def changes_ids_in_place(model, tokens):  # changes the caller's ids
    tokens.clamp_(max=3)
    return PITFALLS["forward_logits"](model, tokens)


def same_input(n, seq, vocab, generator):  # the article's loop: x does not depend on i
    x = torch.randint(0, vocab, (seq,), generator=generator)
    inputs = torch.stack([x for i in range(n)])
    return inputs, inputs.sum(1) % 10


def arange_input(n, seq, vocab, generator):  # the article's data, literally
    inputs = torch.stack([torch.arange(seq) for i in range(n)])
    return inputs, inputs.sum(1) % 10


def float_ids(n, seq, vocab, generator):
    inputs = torch.rand(n, seq, generator=generator) * vocab
    return inputs, inputs.long().sum(1) % 10


def batch_label(n, seq, vocab, generator):  # inputs.sum() % 10: one number for the whole batch, then broadcast
    inputs = torch.randint(0, vocab, (n, seq), generator=generator)
    return inputs, (inputs.sum() % 10).expand(n)


def zero_d_label(n, seq, vocab, generator):  # the article's reshape(): a 0-d label
    inputs = torch.randint(0, vocab, (n, seq), generator=generator)
    return inputs, inputs.sum() % 10


def ids_out_of_range(n, seq, vocab, generator):
    inputs = torch.randint(0, vocab + 1, (n, seq), generator=generator)
    return inputs, inputs.sum(1) % 10


def ignores_generator(n, seq, vocab, generator):
    inputs = torch.randint(0, vocab, (n, seq))
    return inputs, inputs.sum(1) % 10


def stub(*args):
    raise NotImplementedError()


def test_references_pass(capsys: pytest.CaptureFixture[str]) -> None:
    check_forward_logits(PITFALLS["forward_logits"])
    check_make_samples(PITFALLS["make_samples"])
    out = capsys.readouterr().out
    assert "All tests in check_forward_logits passed (batch, seq = (3, 5), (2, 7), (1, 6))" in out
    assert "All tests in check_make_samples passed (n=32, seq=6, vocab=17; seeds 1 and 2)" in out
    assert "FAILED" not in out


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (pooled_over_batch, "model_pitfalls.pooled_batch", {}),
    (pooled_over_batch, "model_pitfalls.mean_over_seq", {}),
    (ids_cast_to_float, "model_pitfalls.ids_float", {}),
    (embedding_cast_to_long, "model_pitfalls.long_reached", {}),
    (no_transpose, "model_pitfalls.no_transpose", {}),
    (not_pooled, "model_pitfalls.not_pooled_seq", {}),
    (no_scale, "model_pitfalls.not_scaled", {}),
    (summed, "model_pitfalls.summed", {}),
    (calls_the_model, "model_pitfalls.called_model", {}),
    (returns_nothing, "model_pitfalls.not_logits", {"kind": "NoneType"}),
    (changes_ids_in_place, "model_pitfalls.changed_tokens", {"changed": "model_pitfalls.changed_values"}),
])
def test_planted_forward_mistakes_are_named(fn: Callable, says: str, fields: dict,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_forward_logits, fn, says=says, fields=fields, capsys=capsys)


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (same_input, "model_pitfalls.same_input", {"n": 32}),
    (arange_input, "model_pitfalls.same_input", {}),
    (float_ids, "model_pitfalls.inputs_dtype", {"dtype": "torch.float32"}),
    (batch_label, "model_pitfalls.same_label", {}),
    (zero_d_label, "model_pitfalls.labels_shape", {"got": (), "expected": (32,)}),
    (ids_out_of_range, "model_pitfalls.ids_range", {"vocab": 17}),
    (ignores_generator, "model_pitfalls.from_generator", {}),
])
def test_planted_data_mistakes_are_named(fn: Callable, says: str, fields: dict,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_make_samples, fn, says=says, fields=fields, capsys=capsys)


def test_the_failure_names_the_case(capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_forward_logits, pooled_over_batch, says="model_pitfalls.pooled_batch", capsys=capsys)
    assert "check_forward_logits FAILED at tokens of shape (batch 3, seq 5), 10 classes" in out
    assert "got      [" in out and "shape (5, 10)" in out


def test_the_stubs_give_one_short_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="stub is not implemented yet"):
        check_forward_logits(stub)
    with pytest.raises(NotImplementedError, match="stub is not implemented yet"):
        check_make_samples(stub)


def test_a_string_instead_of_the_function_is_refused() -> None:
    with pytest.raises(TypeError, match=r"check_forward_logits\(forward_logits\)"):
        check_forward_logits("forward_logits")
