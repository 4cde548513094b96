"""Which samples each rank trains on: a DistributedSampler, and global-batch helpers.

`DistributedSampler` is written out step by step the way the article's Java
`DistributedSamplerCompleteV2.setEpoch` does it:
  1. list all indices 0..n-1,
  2. shuffle them with a generator seeded `seed + epoch` (every rank draws the same order),
  3. pad by repeating from the start (`allIndices.get(size % numSamples)`) until the length is
     num_replicas * ceil(n / num_replicas),
  4. rank r takes every num_replicas-th index starting at r (`for i = rank; i += worldSize`).
Step 2 comes in two flavours (`rng=`):
  - "torch" (the default): `torch.randperm` with a `torch.Generator`, so that the sampler yields
    exactly the indices of `torch.utils.data.DistributedSampler` (PyTorch docs,
    torch/utils/data/distributed.py) for every dataset size, world size, seed, epoch and flag;
  - "java": the article's own shuffle, `Collections.shuffle(allIndices, new Random(seed + epoch))`,
    reproduced bit for bit by `JavaRandom` (java.util.Random: the 48-bit linear congruential
    generator its Javadoc specifies, with `next(bits)`, `nextInt()` and `nextInt(bound)`) and
    `java_shuffle` (Collections.shuffle's loop: for i = size .. 2, swap(i - 1, nextInt(i))).
tests/test_sampler.py checks both: against torch's sampler, and against values printed by Java itself.
The article has no `drop_last`; this sampler adds it. Unlike PyTorch's, it never asks
`torch.distributed` for the world size or rank: ranks here are threads, so both are passed explicitly.

For equivalence tests (one process on the global batch vs N ranks on their parts):
  - `global_batches(n, batch_size, seed=, epoch=)`: the epoch's shuffled order cut into batches.
  - `rank_slice(batch, rank, world_size)`: rank r's *contiguous* part of a global batch;
    `torch.cat([rank_slice(b, r, W) for r in range(W)]) == b` exactly.
With equal parts and a mean loss, the mean over ranks of each rank's mean-loss gradient equals the
full-batch gradient (up to rounding): the identity data parallelism rests on (ZeRO, arXiv:1910.02054).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableSequence, Sequence, Sized
from typing import Literal, TypeVar

import torch
from torch import Tensor
from torch.utils.data import Sampler

__all__ = ["DistributedSampler", "JavaRandom", "epoch_order", "global_batch", "global_batches", "java_shuffle",
           "rank_slice"]

Rng = Literal["torch", "java"]
T = TypeVar("T")


def _length(dataset: Sized | int) -> int:
    n = dataset if isinstance(dataset, int) else len(dataset)
    if n < 0:
        raise ValueError(f"dataset size must be >= 0, got {n}")
    return n


class JavaRandom:
    """java.util.Random, bit for bit: a 48-bit linear congruential generator (the Javadoc of java.util.Random).

    The seed is scrambled as `(seed ^ 0x5DEECE66D) & (2**48 - 1)`; each step is
    `seed = (seed * 0x5DEECE66D + 0xB) & (2**48 - 1)`, and `next(bits)` returns the top `bits` of the 48
    as a Java `int` (signed 32-bit). `next_int()` is `nextInt()`, `next_int(bound)` is `nextInt(bound)`.
    """

    MULTIPLIER = 0x5DEECE66D
    ADDEND = 0xB
    MASK = (1 << 48) - 1

    def __init__(self, seed: int) -> None:
        self._seed = (seed ^ self.MULTIPLIER) & self.MASK

    def next(self, bits: int) -> int:
        """Java's `protected int next(int bits)`: the top `bits` bits of the new 48-bit state, as a signed int."""
        self._seed = (self._seed * self.MULTIPLIER + self.ADDEND) & self.MASK
        value = (self._seed >> (48 - bits)) & 0xFFFFFFFF
        return value - (1 << 32) if value >= 1 << 31 else value

    def next_int(self, bound: int | None = None) -> int:
        """`nextInt()` (any int) or `nextInt(bound)`: uniform in [0, bound), with Java's rejection loop."""
        if bound is None:
            return self.next(32)
        if bound <= 0:
            raise ValueError(f"bound must be positive, got {bound}")
        r = self.next(31)
        m = bound - 1
        if bound & m == 0:  # a power of two: the top bits
            return (bound * r) >> 31
        u = r
        r = u % bound
        while u - r + m > 0x7FFFFFFF:  # Java: `u - r + m < 0`, an int overflow: reject and draw again
            u = self.next(31)
            r = u % bound
        return r


def java_shuffle(items: MutableSequence[T], rnd: JavaRandom) -> MutableSequence[T]:
    """`java.util.Collections.shuffle(list, rnd)` in place (its loop for a RandomAccess list such as ArrayList):
    for i from size down to 2, swap positions i - 1 and rnd.nextInt(i). Returns `items`."""
    for i in range(len(items), 1, -1):
        j = rnd.next_int(i)
        items[i - 1], items[j] = items[j], items[i - 1]
    return items


def _java_int(value: int) -> int:
    """Wrap to a Java `int` (signed 32-bit), as Java's `seed + epoch` does on overflow."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True, rng: Rng = "torch") -> Tensor:
    """The global order of one epoch, (n,) indices, or 0..n-1 without shuffling. The sampler and global_batches
    share it. rng="torch": torch.randperm(n) from a generator seeded seed + epoch (torch's DistributedSampler
    draws it so); rng="java": the article's `Collections.shuffle(0..n-1, new Random(seed + epoch))`."""
    if not shuffle:
        return torch.arange(n)
    if rng == "java":
        return torch.tensor(java_shuffle(list(range(n)), JavaRandom(_java_int(seed + epoch))), dtype=torch.long)
    if rng != "torch":
        raise ValueError(f'rng must be "torch" or "java", got {rng!r}')
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g)


class DistributedSampler(Sampler[int]):
    """Same indices as `torch.utils.data.DistributedSampler`; world size and rank given explicitly.

    dataset: anything with len(), or the number of samples. Iterating yields this rank's
    `len(self)` indices for the current epoch; call `set_epoch(e)` before each epoch to reshuffle.
    rng="java" shuffles as the article's Java sampler does (java.util.Random, Collections.shuffle) instead.
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rng: Rng = "torch",
    ) -> None:
        if rng not in ("torch", "java"):
            raise ValueError(f'rng must be "torch" or "java", got {rng!r}')
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {num_replicas - 1}]")
        self.dataset_size = _length(dataset)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rng: Rng = rng
        self.epoch = 0
        if drop_last:
            # cut the tail so every rank gets the same count without repeats
            self.num_samples = self.dataset_size // num_replicas
        else:
            # the article's numSamplesPerRank = (numSamples + worldSize - 1) / worldSize
            self.num_samples = -(-self.dataset_size // num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use a different (but rank-agreed) order next epoch: the generator seed is seed + epoch."""
        self.epoch = epoch

    def all_indices(self) -> list[int]:
        """The padded (or cut) global order of this epoch, before it is split among ranks."""
        indices = epoch_order(self.dataset_size, self.seed, self.epoch, self.shuffle, self.rng).tolist()
        if self.drop_last:
            return indices[: self.total_size]
        # pad by going round again from the start, as the article's while loop does
        original = len(indices)
        while len(indices) < self.total_size:
            indices.append(indices[len(indices) % original])
        return indices

    def indices(self) -> list[int]:
        """This rank's indices: every num_replicas-th of `all_indices()`, starting at rank."""
        return self.all_indices()[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"DistributedSampler(size={self.dataset_size}, num_replicas={self.num_replicas}, "
                f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last}, rng={self.rng!r}, epoch={self.epoch})")


def global_batches(
    n: int,
    batch_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
) -> list[Tensor]:
    """One epoch of global batches: LongTensors of indices into a data set of n samples.

    The order is the one a DistributedSampler with the same seed and epoch shuffles
    (`torch.randperm(n)` from a generator seeded seed + epoch), cut into consecutive batches.
    drop_last=True drops a final batch smaller than batch_size.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    batches = list(torch.split(epoch_order(n, seed, epoch, shuffle), batch_size))
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


def global_batch(n: int, batch_size: int, step: int, *, seed: int = 0,
                 shuffle: bool = True) -> Tensor:
    """The indices of the global batch for training step `step`, counting across epochs.

    Each epoch has n // batch_size full batches; step k is batch k % that of epoch
    k // that, so a loop can run more steps than one epoch holds.
    """
    per_epoch = n // batch_size
    if per_epoch < 1:
        raise ValueError(f"batch_size={batch_size} is larger than the data set ({n} samples)")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    epoch, k = divmod(step, per_epoch)
    return global_batches(n, batch_size, seed=seed, epoch=epoch, shuffle=shuffle)[k]


def rank_slice(batch: Tensor | Sequence[int], rank: int, world_size: int, *,
               allow_uneven: bool = False) -> Tensor:
    """Rank `rank`'s contiguous part of a global batch (indices or data, split along dim 0).

    Part r is batch[r * B // W : (r + 1) * B // W] when W divides B, so concatenating the parts
    in rank order gives the global batch back exactly. If W does not divide B this raises,
    because averaging per-rank *mean* losses over unequal parts is not the global mean;
    allow_uneven=True splits like `torch.tensor_split` (the first B % W ranks get one more).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size - 1}]")
    t = batch if isinstance(batch, Tensor) else torch.as_tensor(list(batch), dtype=torch.long)
    size = t.shape[0]
    if size % world_size and not allow_uneven:
        raise ValueError(f"global batch of {size} does not split evenly over {world_size} ranks; "
                         f"pick a batch size divisible by the world size or pass allow_uneven=True")
    return torch.tensor_split(t, world_size)[rank]
