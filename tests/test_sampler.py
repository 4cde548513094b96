"""Tests for fsdp_course.sampler: index-for-index equality with torch's DistributedSampler,
errors, and the global-batch / rank-slice helpers the equivalence tests rely on."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data import DistributedSampler as TorchDistributedSampler

from fsdp_course.sampler import DistributedSampler, global_batch, global_batches, rank_slice

SIZES = [0, 1, 2, 3, 5, 7, 8, 10, 16, 17, 31, 100, 1797]


@pytest.mark.parametrize("n", SIZES)
def test_same_indices_as_torch(n):
    for world, shuffle, drop_last in itertools.product(range(1, 9), (True, False), (True, False)):
        for rank in range(world):
            ours = DistributedSampler(n, world, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            ref = TorchDistributedSampler(range(n), world, rank, shuffle=shuffle, seed=7,
                                          drop_last=drop_last)
            for epoch in (0, 1, 3):
                ours.set_epoch(epoch)
                ref.set_epoch(epoch)
                assert list(ours) == list(ref), (n, world, rank, shuffle, drop_last, epoch)
                assert len(ours) == len(ref)


@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_partition_the_epoch(drop_last):
    n, world = 103, 4
    samplers = [DistributedSampler(n, world, r, seed=1, drop_last=drop_last) for r in range(world)]
    got = sorted(i for s in samplers for i in s)
    if drop_last:
        assert len(got) == len(set(got)) == 100  # 3 samples cut, none repeated
    else:
        assert set(got) == set(range(n)) and len(got) == 104  # one sample repeated as padding


def test_epochs_reshuffle_and_seed_matters():
    s = DistributedSampler(50, 2, 0, seed=0)
    e0 = list(s)
    assert list(s) == e0  # same epoch, same order
    s.set_epoch(1)
    assert list(s) != e0
    assert list(DistributedSampler(50, 2, 0, seed=1)) != e0
    assert list(DistributedSampler(50, 2, 0, shuffle=False)) == list(range(0, 50, 2))


def test_accepts_a_dataset_and_works_with_dataloader():
    data = torch.arange(20) * 10
    sampler = DistributedSampler(data, num_replicas=3, rank=1, seed=2)
    batches = list(DataLoader(data, batch_size=4, sampler=sampler))
    assert torch.cat(batches).tolist() == [10 * i for i in sampler]


@pytest.mark.parametrize("world,rank", [(2, 2), (2, -1), (1, 1)])
def test_bad_rank_raises(world, rank):
    with pytest.raises(ValueError, match="rank"):
        DistributedSampler(10, world, rank)


@pytest.mark.parametrize("world", [0, -2])
def test_bad_num_replicas_raises(world):
    with pytest.raises(ValueError, match="num_replicas"):
        DistributedSampler(10, world, 0)


def test_global_batches_follow_the_samplers_order():
    n, bs = 23, 5
    batches = global_batches(n, bs, seed=4, epoch=2)
    assert [len(b) for b in batches] == [5, 5, 5, 5]  # last 3 dropped
    assert len(global_batches(n, bs, seed=4, epoch=2, drop_last=False)[-1]) == 3
    # same permutation as a one-rank sampler with that seed and epoch
    s = DistributedSampler(n, 1, 0, seed=4)
    s.set_epoch(2)
    assert torch.cat(batches).tolist() == list(s)[:20]
    assert torch.cat(global_batches(n, bs, shuffle=False)).tolist() == list(range(20))


def test_global_batch_walks_across_epochs():
    n, bs = 23, 5
    assert torch.equal(global_batch(n, bs, 3, seed=4), global_batches(n, bs, seed=4)[3])
    assert torch.equal(global_batch(n, bs, 6, seed=4),
                       global_batches(n, bs, seed=4, epoch=1)[2])
    with pytest.raises(ValueError):
        global_batch(3, 5, 0)
    with pytest.raises(ValueError):
        global_batch(n, bs, -1)


def test_rank_slices_concatenate_to_the_global_batch():
    batch = global_batches(100, 24, seed=0)[1]
    for world in (1, 2, 3, 4, 6, 8):
        parts = [rank_slice(batch, r, world) for r in range(world)]
        assert all(len(p) == 24 // world for p in parts)
        assert torch.equal(torch.cat(parts), batch)
    x = torch.randn(12, 3)
    assert torch.equal(rank_slice(x, 2, 4), x[6:9])
    assert rank_slice([5, 6, 7, 8], 1, 2).tolist() == [7, 8]


def test_rank_slice_uneven():
    batch = torch.arange(10)
    with pytest.raises(ValueError, match="evenly"):
        rank_slice(batch, 0, 3)
    parts = [rank_slice(batch, r, 3, allow_uneven=True) for r in range(3)]
    assert [len(p) for p in parts] == [4, 3, 3]
    assert torch.equal(torch.cat(parts), batch)
    with pytest.raises(ValueError):
        rank_slice(batch, 3, 3)
    with pytest.raises(ValueError):
        rank_slice(batch, 0, 0)


def test_mean_of_rank_gradients_is_the_global_gradient():
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x, y = torch.randn(16, 3), torch.randn(16)
    loss = ((x @ w - y) ** 2).mean()
    (full,) = torch.autograd.grad(loss, w)
    grads = []
    for r in range(4):
        xs, ys = rank_slice(x, r, 4), rank_slice(y, r, 4)
        grads.append(torch.autograd.grad(((xs @ w - ys) ** 2).mean(), w)[0])
    assert (torch.stack(grads).mean(0) - full).abs().max() < 1e-5 * full.abs().max()
