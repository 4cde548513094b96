"""Models the course trains: the article's Transformer classifier and a small MLP.

`TransformerClassifier` is the model of section 4.1 of the article the course follows
(`TransformerModelV2`, PyTorch's Java bindings): token embedding, scaled by sqrt(d_model),
a stack of post-norm `TransformerEncoderLayer`s (ReLU, dim_feedforward = 4 * d_model,
no final LayerNorm), mean over the sequence, one Linear head. At the article's size
(`TransformerConfig.article()`) it has exactly 29,164,304 parameters, the number the
article's log prints for its flat parameter.

Two things the article's model lacks, both off by default so the default *is* the article:
  - `positional=True`: a learned positional embedding. Without one, self-attention followed by
    a mean is blind to token order: the model sees a bag of tokens. Positions are added *before*
    the sqrt(d_model) scale, so both start at the same size (nn.Embedding draws N(0, 1)); added
    after it, they start sqrt(d_model) times smaller than the tokens and, measured on digits,
    the model barely learns to use them (26% held-out instead of 84% after 200 steps).
  - `pre_norm=True`: LayerNorm before attention/MLP (`norm_first=True`) plus a final LayerNorm
    after the stack (the "Pre-LN" Transformer, Xiong et al., arXiv:2002.04745).

Note on the article's head: it is `Linear(d_model, vocab_size)`, not `Linear(d_model, 10)`,
although its data has 10 classes (its first loss, 9.157, is about ln 10000). The 29,164,304
count includes that 10000-way head, so `TransformerConfig.article()` sets num_classes=10000.

Layout: inputs are (B, T) token ids; internally the encoder runs on [T, B, d] as in the article
(`batch_first=False`). That also keeps PyTorch's inference "fast path" (taken only for
batch_first=True in eval mode) out of the way, so train mode, eval mode and no_grad all run the
same kernels and give the same numbers.

References: PyTorch docs for nn.TransformerEncoder / nn.TransformerEncoderLayer;
PyTorch FSDP (arXiv:2304.11277) wraps the encoder layers as FSDP units, which `wrap=` mirrors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MLP", "TransformerClassifier", "TransformerConfig", "count_parameters"]


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes and options of a `TransformerClassifier`. dim_feedforward is always 4 * d_model."""

    vocab_size: int
    d_model: int
    nhead: int
    num_layers: int
    num_classes: int
    max_len: int
    dropout: float = 0.0
    positional: bool = False
    pre_norm: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.nhead != 0:
            raise ValueError(f"d_model={self.d_model} must be divisible by nhead={self.nhead}")
        for name in ("vocab_size", "d_model", "nhead", "num_layers", "num_classes", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def dim_feedforward(self) -> int:
        return 4 * self.d_model

    @classmethod
    def article(cls, **overrides: Any) -> TransformerConfig:
        """The article's size: vocab 10000, d_model 512, 8 heads, 6 layers -> 29,164,304 params.

        num_classes is 10000 because the article's head maps to vocab_size (see module docstring).
        The article trains with dropout 0.1; here dropout defaults to 0.0 so outputs compare
        exactly across ranks; pass dropout=0.1 to match it.
        """
        base = cls(vocab_size=10000, d_model=512, nhead=8, num_layers=6, num_classes=10000,
                   max_len=784)
        return replace(base, **overrides)

    @classmethod
    def small(cls, **overrides: Any) -> TransformerConfig:
        """Lesson size for the digits tokens: 17 grey levels, 64 pixels, 10 classes (28,394 params).

        positional and pre_norm are on; `small(positional=False, pre_norm=False)` is the
        article's architecture at this size (26,282 params). Measured (torch 2.13 CPU,
        `train_test_split_digits(seed=0)`, AdamW lr=1e-2, batches `global_batch(n, 64, step)`,
        300 steps, seed 0): 92.5% held-out with both options on (84-91% over 8 seeds with random
        batches); 27.3% with both off (order-blind: it only sees how many pixels have each grey
        level). 300 steps take about 7 s on 2 idle CPU cores.
        """
        base = cls(vocab_size=17, d_model=32, nhead=4, num_layers=2, num_classes=10, max_len=64,
                   positional=True, pre_norm=True)
        return replace(base, **overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> TransformerConfig:
        """A very small model for unit tests and sharding pictures (~2.5k params)."""
        base = cls(vocab_size=17, d_model=8, nhead=2, num_layers=2, num_classes=10, max_len=64,
                   positional=True, pre_norm=True)
        return replace(base, **overrides)


class TransformerClassifier(nn.Module):
    """The article's `TransformerModelV2` (section 4.1), plus optional positions and pre-norm.

    forward: LongTensor (B, T) token ids -> logits (B, num_classes).
    Submodule names follow the article: `embedding`, `encoder`, `fc` (+ `pos_embedding`).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_embedding = nn.Embedding(c.max_len, c.d_model) if c.positional else None
        layer = nn.TransformerEncoderLayer(
            d_model=c.d_model, nhead=c.nhead, dim_feedforward=c.dim_feedforward,
            dropout=c.dropout, activation="relu", batch_first=False, norm_first=c.pre_norm,
        )
        final_norm = nn.LayerNorm(c.d_model) if c.pre_norm else None  # the article has none
        # nn.TransformerEncoder deep-copies `layer` num_layers times.
        self.encoder = nn.TransformerEncoder(layer, c.num_layers, norm=final_norm,
                                             enable_nested_tensor=False)
        self.fc = nn.Linear(c.d_model, c.num_classes)
        self.scale = math.sqrt(c.d_model)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"expected token ids of shape (B, T), got {tuple(tokens.shape)}")
        T = tokens.shape[1]
        if T > self.config.max_len and self.pos_embedding is not None:
            raise ValueError(f"sequence length {T} > max_len {self.config.max_len}")
        x = self.embedding(tokens)  # (B, T, d)
        if self.pos_embedding is not None:
            pos = torch.arange(T, device=tokens.device)
            x = x + self.pos_embedding(pos)  # (T, d) broadcast over B
        x = x * self.scale  # the article's mul(sqrt(d_model)), positions scaled alike
        x = x.transpose(0, 1)  # (T, B, d): the article's [seq_len, batch, d_model]
        x = self.encoder(x)  # (T, B, d)
        x = x.mean(dim=0)  # (B, d): mean over the sequence, the article's x.mean(0)
        return self.fc(x)  # (B, num_classes)


class MLP(nn.Module):
    """Linear layers with ReLU between them (none after the last): MLP([64, 128, 10]).

    The article's `SimpleNetComplete` is MLP([784, 128, 128, 10]). Layers are `layers.0`,
    `layers.1`, ... so FSDP lessons can wrap each nn.Linear as its own unit.
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        super().__init__()
        sizes = list(sizes)
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least an input and an output size, got {sizes}")
        self.sizes = sizes
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=True))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def count_parameters(module: nn.Module, *, trainable_only: bool = False) -> int:
    """Total number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
