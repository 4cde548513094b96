"""fsdp_course.demos.pitfalls, lesson 10's machinery: what the lesson's own run does not reach (a record without an
address, an engine's peaks at a world size the lesson does not use, a plain loop without a `before`)."""

from __future__ import annotations

import socket

import pytest
import torch

from fsdp_course.demos.pitfalls import (
    _published_address,
    article_trainer_peak,
    fixed_batch_losses,
    one_step_peaks,
    train_sgd,
)
from fsdp_course.engines.equivalence import max_rel_diff
from fsdp_course.models import MLP, count_parameters
from fsdp_course.runtime.simulate import run_ranks


def _data(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP([8, 6, 3])  # 75 parameters: divides by 1 and 3, not by 2


def test_published_address_reads_the_first_sockaddr_with_a_port() -> None:
    record = b"\x02\x00" + bytes(6) + b"xy" + bytes(6) + b"\x02\x00\x9e\xc7" + socket.inet_aton("10.1.2.3") + bytes(8)
    assert _published_address(record) == ("10.1.2.3", 0x9EC7)
    with pytest.raises(ValueError, match="no IPv4 address"):
        _published_address(b"\x02\x00" + bytes(6))


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_article_trainer_holds_four_plus_two_over_n_psi(world_size: int) -> None:
    model, (x, y) = _mlp(), _data()
    psi = count_parameters(model)
    peaks = run_ranks(lambda ctx: article_trainer_peak(ctx, model, x, y, batch=6), world_size)
    assert peaks == [4 * (4 * psi + 2 * psi // world_size)] * world_size


def test_one_step_peaks_of_ddp_are_two_psi_on_every_rank() -> None:
    from fsdp_course.engines.ddp import DDP

    model, (x, y) = _mlp(), _data()
    measured = one_step_peaks(model, {"DDP": DDP}, [3], x, y, batch=6)
    assert [m.peak for m in measured["DDP", 3]] == [4 * 2 * count_parameters(model)] * 3
    assert all(m.units == {} and m.gathered == 0 for m in measured["DDP", 3])


def test_train_sgd_on_ranks_matches_one_process_without_a_clip() -> None:
    model, (x, y) = _mlp(), _data()
    one = train_sgd(None, model, x, y, steps=2, batch=6, lr=0.1)
    ranks = run_ranks(lambda ctx: train_sgd(ctx, model, x, y, steps=2, batch=6, lr=0.1), 2)  # padded: 75 over 2
    assert one.scales == [1.0, 1.0]
    assert max(max_rel_diff(ranks[0].state[k], v) for k, v in one.state.items()) < 1e-5


def test_fixed_batch_losses_runs_before_at_every_step_and_lowers_the_loss() -> None:
    model, (x, y) = _mlp(), _data()
    calls = []
    losses = fixed_batch_losses(model, torch.optim.SGD(model.parameters(), lr=0.5), x, y, steps=3,
                                before=lambda: calls.append(1))
    assert len(calls) == 3 and losses[0] > losses[-1]
    still = fixed_batch_losses(model, torch.optim.SGD(model.parameters(), lr=0.0), x, y, steps=2)  # no `before`
    assert still[0] == still[1]
