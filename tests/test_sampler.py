"""Tests for fsdp_course.sampler: index-for-index equality with torch's DistributedSampler, the article's
Java shuffle against values printed by Java itself, errors, and the global-batch / rank-slice helpers the
equivalence tests rely on."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data import DistributedSampler as TorchDistributedSampler

from fsdp_course.sampler import DistributedSampler, JavaRandom, global_batch, global_batches, java_shuffle, rank_slice

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


# Printed by OpenJDK 17.0.15 and 25.0.3 (the same on both), e.g. in jshell:
#   new Random(42).nextInt()                                  -> -1170105035
#   var r = new Random(42); r.nextInt(10); r.nextInt(100); ...  (the bounds below)
#   var l = new ArrayList<Long>(); for (long i = 0; i < 100; i++) l.add(i); Collections.shuffle(l, new Random(42));
JAVA_NEXT_INT = {42: [-1170105035], 0: [-1155484576, -723955400]}
JAVA_BOUNDED_42 = [(10, 0), (100, 63), (7, 6), (16, 0), (1 << 30, 331484985), (1000000007, 595021505), (2, 1),
                   (3, 1)]
# nextInt(2**30 + 1) rejects about half of its draws: this exercises Java's rejection loop
JAVA_REJECTING_42 = [117392763, 102948884, 662969970, 595021505, 196118093, 969067502, 791955276, 819572292,
                     592164476, 995688456, 326327863, 937357226]
JAVA_SHUFFLE_100 = {
    42: [87, 63, 71, 69, 81, 54, 70, 51, 12, 64, 24, 41, 60, 97, 3, 98, 6, 46, 45, 55, 37, 21, 57, 89, 8, 13, 91,
         92, 36, 10, 4, 53, 73, 74, 76, 77, 95, 83, 78, 17, 42, 84, 16, 33, 62, 58, 52, 67, 28, 50, 43, 93, 5, 56,
         39, 31, 49, 23, 22, 72, 14, 25, 61, 11, 75, 65, 20, 85, 27, 79, 99, 19, 59, 44, 66, 47, 9, 26, 88, 40, 35,
         29, 86, 0, 82, 38, 94, 96, 90, 2, 80, 7, 32, 1, 15, 18, 68, 34, 48, 30],
    43: [93, 81, 47, 49, 77, 7, 29, 45, 75, 28, 61, 31, 58, 26, 52, 51, 42, 13, 3, 27, 70, 66, 32, 69, 14, 78, 95,
         23, 80, 36, 2, 71, 43, 97, 0, 62, 21, 99, 82, 30, 74, 57, 48, 54, 67, 12, 83, 1, 68, 86, 73, 94, 16, 33,
         18, 88, 25, 19, 10, 90, 35, 63, 11, 8, 50, 20, 59, 79, 15, 9, 76, 60, 55, 46, 40, 41, 91, 5, 84, 65, 85,
         92, 98, 89, 37, 72, 24, 64, 38, 4, 34, 87, 44, 22, 6, 53, 96, 39, 17, 56],
}
# the article's DistributedSamplerCompleteV2(10, rank, 4, true, 42).setEpoch(e).getIndices() for rank 0..3, in Java
JAVA_SAMPLER_10_OVER_4 = {0: [[4, 7, 3], [6, 9, 0], [2, 8, 4], [1, 5, 6]],
                          1: [[4, 1, 8], [7, 5, 6], [2, 3, 4], [0, 9, 7]]}


def test_java_random_matches_java() -> None:
    for seed, values in JAVA_NEXT_INT.items():
        rnd = JavaRandom(seed)
        assert [rnd.next_int() for _ in values] == values
    rnd = JavaRandom(42)
    assert [rnd.next_int(bound) for bound, _ in JAVA_BOUNDED_42] == [v for _, v in JAVA_BOUNDED_42]
    rnd = JavaRandom(42)
    assert [rnd.next_int((1 << 30) + 1) for _ in JAVA_REJECTING_42] == JAVA_REJECTING_42
    assert JavaRandom(-1).next_int(1000) == 913  # a negative seed: new Random(-1).nextInt(1000)
    with pytest.raises(ValueError, match="bound"):
        JavaRandom(0).next_int(0)


def test_java_shuffle_matches_collections_shuffle() -> None:
    for seed, order in JAVA_SHUFFLE_100.items():
        assert java_shuffle(list(range(100)), JavaRandom(seed)) == order
    assert java_shuffle(list(range(10)), JavaRandom(42)) == [4, 6, 2, 1, 7, 9, 8, 5, 3, 0]
    assert java_shuffle([], JavaRandom(42)) == [] and java_shuffle([7], JavaRandom(42)) == [7]


def test_the_articles_sampler_with_rng_java() -> None:
    # epoch e shuffles with new Random(seed + e): epoch 1 of seed 42 is seed 43's order
    for epoch, seed in ((0, 42), (1, 43)):
        s = DistributedSampler(100, 1, 0, seed=42, rng="java")
        s.set_epoch(epoch)
        assert s.all_indices() == JAVA_SHUFFLE_100[seed]
    for epoch, ranks in JAVA_SAMPLER_10_OVER_4.items():  # padding and dealing, as the Java class does them
        samplers = [DistributedSampler(10, 4, r, seed=42, rng="java") for r in range(4)]
        for s in samplers:
            s.set_epoch(epoch)
        assert [list(s) for s in samplers] == ranks
    torch_order = DistributedSampler(100, 1, 0, seed=42).all_indices()
    assert torch_order != JAVA_SHUFFLE_100[42] and sorted(torch_order) == list(range(100))
    assert list(DistributedSampler(10, 2, 1, shuffle=False, rng="java")) == [1, 3, 5, 7, 9]
    with pytest.raises(ValueError, match="rng"):
        DistributedSampler(10, 2, 0, rng="numpy")  # type: ignore[arg-type]
