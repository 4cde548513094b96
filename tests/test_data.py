"""Tests for fsdp_course.data: the bundled digits, both views, and the deterministic split."""

from __future__ import annotations

import pytest
import torch

from fsdp_course.data import (
    NUM_CLASSES,
    NUM_GREY_LEVELS,
    NUM_PIXELS,
    digits_tokens,
    digits_vectors,
    train_test_split_digits,
)


def test_tokens_shape_range_and_labels():
    x, y = digits_tokens()
    assert x.shape == (1797, NUM_PIXELS) and x.dtype == torch.long
    assert y.shape == (1797,) and y.dtype == torch.long
    assert x.min() == 0 and x.max() == NUM_GREY_LEVELS - 1
    assert sorted(y.unique().tolist()) == list(range(NUM_CLASSES))
    assert torch.bincount(y).min() >= 170  # roughly balanced: ~180 per digit


def test_vectors_are_tokens_over_16():
    xt, yt = digits_tokens()
    xv, yv = digits_vectors()
    assert xv.dtype == torch.float32 and xv.shape == (1797, 64)
    assert 0.0 <= xv.min() and xv.max() == 1.0
    assert torch.equal(xv * 16, xt.float())
    assert torch.equal(yv, yt)


def test_calls_return_fresh_tensors():
    x1, y1 = digits_tokens()
    x1.zero_()
    y1.fill_(-1)
    x2, y2 = digits_tokens()
    assert x2.max() == 16 and y2.min() == 0


@pytest.mark.parametrize("kind", ["tokens", "vectors"])
def test_split_is_deterministic_disjoint_and_complete(kind):
    a = train_test_split_digits(kind, seed=0)
    b = train_test_split_digits(kind, seed=0)
    for ta, tb in zip(a, b, strict=True):
        assert torch.equal(ta, tb)
    assert a.x_train.shape[0] == 1797 - 359 and a.x_test.shape[0] == 359
    x_all, _ = digits_tokens() if kind == "tokens" else digits_vectors()
    # every image lands in exactly one part: compare as sorted rows
    joined = torch.cat([a.x_train, a.x_test])
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert key(joined) == key(x_all)


def test_split_depends_on_seed_and_not_on_global_rng():
    torch.manual_seed(123)
    a = train_test_split_digits(seed=0)
    torch.manual_seed(456)
    b = train_test_split_digits(seed=0)
    c = train_test_split_digits(seed=1)
    assert torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.y_test, c.y_test)


def test_split_rejects_bad_arguments():
    with pytest.raises(ValueError):
        train_test_split_digits(test_fraction=0.0)
    with pytest.raises(ValueError):
        train_test_split_digits(test_fraction=1.5)
    with pytest.raises(ValueError, match="kind"):
        train_test_split_digits("pixels")  # type: ignore[arg-type]


def test_read_from_scikit_learns_file_equals_load_digits_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    bunch = load_digits()
    x, y = digits_tokens()
    assert torch.equal(x, torch.as_tensor(bunch.data, dtype=torch.long))
    assert torch.equal(y, torch.as_tensor(bunch.target, dtype=torch.long))
    code = "import sys; from fsdp_course.data import digits_tokens; digits_tokens(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "reading the digits imported scikit-learn (seconds per process)"
