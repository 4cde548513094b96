"""Initial weights that do not need the whole model in memory: piecewise, seeded, meta-device friendly.

Why: a process that builds the whole model before sharding it holds the whole model once, even if it
keeps only 1/N of it afterwards. PyTorch's answer (the `fully_shard` docs, "meta-device initialization",
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html; the FSDP paper,
arXiv:2304.11277, section 3.1 "deferred initialization") is to build the model on the
`meta` device (shapes, no storage), shard it, then materialize and initialize only the local shards.

The catch: `nn.Module` constructors initialize by drawing from one global RNG stream, in
construction order, so a piece's values depend on everything built before it. Here each *piece*
(an outermost module that owns parameters: an Embedding, a Linear, an attention block) is initialized by its
own `reset_parameters()` under its own seed, derived from (seed, the piece's name). The values then
do not depend on order or on which other pieces exist, and two routes give identical weights:

  init_weights(model, seed)                  # a real model, re-initialized in place
  materialize(meta_model, seed)              # yields (name, full tensors) for one piece at a time

(Unlike nn.TransformerEncoder's default, which deep-copies one layer, the layers start different.)

Measured (benchmarks/fsdp_vs_torch.py, article model, 1-4 CPU ranks): the training step, not the
construction, sets the peak, so meta-device construction leaves peak RSS unchanged there; what
makes RSS fall with N on CPU is an allocator that returns freed memory (MALLOC_MMAP_THRESHOLD_).
It matters when the whole model does not fit one rank, or N is large enough that a shard plus a
step is smaller than the whole model.
"""

from __future__ import annotations

import copy
import threading
import zlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["init_weights", "materialize", "pieces", "reset_piece"]


def pieces(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Disjoint submodules that together own every parameter: the outermost modules that own
    parameters directly (e.g. "embedding", "encoder.layers.0.self_attn", "encoder.layers.0.linear1")."""
    out: list[tuple[str, nn.Module]] = []

    def walk(mod: nn.Module, name: str) -> None:
        owns = any(p is not None for p in mod._parameters.values())
        if owns:
            out.append((name, mod))
            return
        for child_name, child in mod._modules.items():
            if child is not None:
                walk(child, f"{name}.{child_name}" if name else child_name)

    walk(model, "")
    return out


# reset_piece seeds the global CPU RNG; run_ranks' rank threads share it, so one piece at a time
_RNG_LOCK = threading.Lock()


def _seed_of(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def reset_piece(piece: nn.Module, name: str, seed: int) -> None:
    """Initialize one piece in place: every submodule's reset_parameters(), children before parents
    (so MultiheadAttention's _reset_parameters zeroes out_proj.bias last, as its constructor does)."""
    with _RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed_of(seed, name))
        for sub_name, mod in reversed(list(piece.named_modules())):
            reset = getattr(mod, "reset_parameters", None) or getattr(mod, "_reset_parameters", None)
            if reset is not None:
                reset()
            elif any(p is not None for p in mod._parameters.values()):
                full_name = ".".join(n for n in (name, sub_name) if n) or "the model"
                raise TypeError(f"'{full_name}' ({type(mod).__name__}) owns parameters but has no "
                                "reset_parameters(): add one to initialize it piecewise")


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Re-initialize a real model piece by piece (same values as `materialize` gives); returns it."""
    for name, piece in pieces(model):
        reset_piece(piece, name, seed)
    return model


def materialize(meta_model: nn.Module, seed: int,
                device: torch.device | str = "cpu") -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield (piece name, {full parameter name: tensor}) one piece at a time from a meta-device model.

    Only one piece is ever real: the caller keeps its shard of it and drops the rest before the next.
    """
    for name, piece in pieces(meta_model):
        real = copy.deepcopy(piece).to_empty(device=device)  # this piece only: (its numel,) real bytes
        reset_piece(real, name, seed)
        prefix = f"{name}." if name else ""
        yield name, {prefix + k: v for k, v in real.state_dict().items()}
        del real
