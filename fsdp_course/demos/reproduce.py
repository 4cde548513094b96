"""Reproducing a bug in one line: the error a call raises, one optimizer step on a toy parameter (lessons 05, 09).

    print(error_message(embedding, ids))            # "IndexError: index out of range in self"
    failures = rank_failures(raw_all_gather, 4, timeout=3)                  # {rank: the exception it ended with}
    step, opt = one_step(lambda p: torch.optim.SGD([p], lr=0.01), update)   # what one update did, and its state
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["error_message", "one_step", "rank_failures", "scramble_test"]


def error_message(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """`fn(*args, **kwargs)` is expected to raise: its exception as "TypeName: message". Raises AssertionError if
    the call succeeds (the bug was not reproduced)."""
    try:
        fn(*args, **kwargs)
    except Exception as err:  # the error is the result
        return f"{type(err).__name__}: {err}"
    raise AssertionError(f"{getattr(fn, '__name__', fn)!r} raised nothing: the error was not reproduced")


def one_step(make_optimizer: Callable[[torch.Tensor], torch.optim.Optimizer],
             update: Callable[[torch.optim.Optimizer, torch.Tensor], None],
             numel: int = 4) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """A parameter of `numel` zeros and its optimizer `make_optimizer(param)`; `update(optimizer, param)` runs one
    update. Returns the step the parameter took (its new values) and the optimizer, to read its state."""
    param = torch.zeros(numel, requires_grad=True)
    optimizer = make_optimizer(param)
    update(optimizer, param)
    return param.detach().clone(), optimizer


@torch.no_grad()
def scramble_test(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, perm: torch.Tensor) -> dict[str, float]:
    """A classifier of token sequences on `x` and on `x` with every sequence's tokens reordered by `perm`: its
    accuracy on `x`, the largest change of a logit, and the share of samples whose prediction stays the same."""
    logits, scrambled = model(x), model(x[:, perm])
    return {"accuracy": (logits.argmax(-1) == y).float().mean().item(),
            "change": (scrambled - logits).abs().max().item(),
            "same": (scrambled.argmax(-1) == logits.argmax(-1)).float().mean().item()}


def rank_failures(fn: Callable[[Any], Any], world_size: int, *, timeout: float = 30.0) -> dict[int, BaseException]:
    """Run `fn(ctx)` on `world_size` simulated ranks (`run_ranks`), expecting some to fail: {rank: the exception it
    ended with}, empty when every rank completed."""
    from fsdp_course.runtime.simulate import RankError, run_ranks

    try:
        run_ranks(fn, world_size, timeout=timeout)
    except RankError as err:
        return dict(sorted(err.failures.items()))
    return {}
