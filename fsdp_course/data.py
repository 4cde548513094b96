"""Real data with no download: scikit-learn's bundled handwritten digits.

`sklearn.datasets.load_digits` ships inside the scikit-learn package: 1,797 images of 8x8
pixels, each pixel a grey level 0..16, labels 0..9 (the UCI "Optical Recognition of Handwritten
Digits" test set). The article the course follows trains on 100 random 784-long vectors with
random labels; real data lets a lesson show that a sharded run actually learns.

Two views of the same images:
  - `digits_tokens()`: LongTensor (1797, 64) token ids 0..16, a 64-token "sentence" per image
    for the Transformer classifier (vocab_size 17, max_len 64).
  - `digits_vectors()`: FloatTensor (1797, 64) in [0, 1] for the MLP.
`train_test_split_digits()` gives a deterministic held-out split of either view.

The file is read straight from scikit-learn's package folder (no scikit-learn import, which costs seconds per
process), and parsed once (function-level `lru_cache`, read-only numpy arrays); every call returns
fresh tensors, so callers may modify what they get. Nothing here touches the global RNG.

References: scikit-learn docs, `sklearn.datasets.load_digits`.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DigitsSplit",
    "NUM_CLASSES",
    "NUM_GREY_LEVELS",
    "NUM_PIXELS",
    "digits_tokens",
    "digits_vectors",
    "train_test_split_digits",
]

NUM_PIXELS = 64  # 8x8 image, flattened row by row
NUM_GREY_LEVELS = 17  # pixel values 0..16: the token vocabulary
NUM_CLASSES = 10
NUM_IMAGES = 1797  # scikit-learn's digits


def _bundled_csv() -> Path | None:
    """scikit-learn's own copy of the digits (sklearn/datasets/data/digits.csv.gz), found without importing
    scikit-learn (its import, scipy included, costs 1.5-2 s in every process that trains)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


@lru_cache(maxsize=1)
def _load() -> tuple[np.ndarray, np.ndarray]:
    path = _bundled_csv()
    if path is not None:  # the file load_digits reads: 64 pixels then the label per row
        table = np.loadtxt(path, delimiter=",", dtype=np.int64)  # (1797, 65)
        pixels, labels = np.ascontiguousarray(table[:, :-1]), np.ascontiguousarray(table[:, -1])
    else:  # another layout of scikit-learn: ask it
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels = np.asarray(bunch.data, dtype=np.int64)  # (1797, 64), values 0..16
        labels = np.asarray(bunch.target, dtype=np.int64)  # (1797,)
    pixels.setflags(write=False)
    labels.setflags(write=False)
    return pixels, labels


def digits_tokens() -> tuple[Tensor, Tensor]:
    """(tokens, labels): LongTensor (1797, 64) with ids 0..16, LongTensor (1797,) with 0..9."""
    pixels, labels = _load()
    return torch.tensor(pixels), torch.tensor(labels)


def digits_vectors() -> tuple[Tensor, Tensor]:
    """(x, labels): FloatTensor (1797, 64) scaled to [0, 1] (pixel / 16), LongTensor labels."""
    pixels, labels = _load()
    x = torch.tensor(pixels, dtype=torch.float32) / (NUM_GREY_LEVELS - 1)
    return x, torch.tensor(labels)


class DigitsSplit(NamedTuple):
    """Train and held-out parts; unpacks as x_train, y_train, x_test, y_test."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


def train_test_split_digits(
    kind: Literal["tokens", "vectors"] = "tokens",
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> DigitsSplit:
    """A deterministic shuffled split: the same `seed` gives the same split on every machine.

    The permutation comes from `torch.randperm` with a private `torch.Generator(seed)`;
    the last round(1797 * test_fraction) images of it are the held-out set (359 for 0.2).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if kind == "tokens":
        x, y = digits_tokens()
    elif kind == "vectors":
        x, y = digits_vectors()
    else:
        raise ValueError(f"kind must be 'tokens' or 'vectors', got {kind!r}")
    n = x.shape[0]
    n_test = round(n * test_fraction)
    if not 0 < n_test < n:
        raise ValueError(f"test_fraction={test_fraction} leaves an empty train or test set")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    train, test = perm[: n - n_test], perm[n - n_test :]
    return DigitsSplit(x[train], y[train], x[test], y[test])
