"""Loss scaling for fp16 over sharded gradients: `ShardedGradScaler`, whose found-inf check is global.

fp16 has 5 exponent bits: its smallest subnormal is 2**-24, and gradients below 2**-25 round to zero. Loss scaling
(Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740, section 3.2) multiplies the loss by S before
backward, so the gradients are S times larger while in fp16, and divides them by S (in fp32, on the shard) before
the step; when S was too large some gradient is inf or NaN: the step is skipped and S halves; after
`growth_interval` clean steps S doubles. This is torch.amp.GradScaler's algorithm (torch/amp/grad_scaler.py), with
the same defaults.

What sharding changes (torch/distributed/fsdp/sharded_grad_scaler.py, `ShardedGradScaler`): each rank holds only its
shard of each gradient, so an inf may sit on one rank alone. Every rank must take the same decision, or one rank
steps its shard while another skips its own: the model's shards then belong to different steps, the same kind of
bug as the article's gradient clipping by each shard's own norm. So the local found-inf flags are all-reduced (max)
before anyone decides.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ShardedGradScaler", "found_inf_everywhere"]


def found_inf_everywhere(ctx: Any, local_found_inf: torch.Tensor) -> torch.Tensor:
    """1.0 on every rank if any rank found an inf or NaN in its shards, else 0.0 (an all-reduce with op max)."""
    flag = local_found_inf.detach().float().reshape(1).clone()
    return ctx.all_reduce(flag, op="max")


class ShardedGradScaler:
    """`scale(loss).backward()`, then `step(optimizer)` (unscales, skips the step on every rank if any rank's
    shards hold an inf or NaN), then `update()`. The API of torch.amp.GradScaler, for the course's rank context.

    `found_inf` is the last decision (True: the step was skipped), `history` every decision with its scale."""

    def __init__(self, ctx: Any, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError("ShardedGradScaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                             f"and growth_interval >= 1, got {init_scale}, {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}")
        self.ctx = ctx
        self.enabled = enabled
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.found_inf: bool | None = None
        self.history: list[tuple[float, bool]] = []  # (scale used, step skipped)
        self._growth_tracker = 0
        self._unscaled: set[int] = set()  # ids of the optimizers unscaled in this step
        self._decided: bool | None = None

    def get_scale(self) -> float:
        return self.scale_value if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale (call `.backward()` on this)."""
        return loss * self.scale_value if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide this rank's gradients by the scale (in their own dtype, fp32 shards) and decide, with every rank,
        whether any holds an inf or NaN. Call it before clipping; `step` calls it if you did not."""
        if not self.enabled:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update()")
        local = torch.zeros((), device=self.ctx.device)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.grad.mul_(1.0 / self.scale_value)
                local = torch.maximum(local, (~torch.isfinite(p.grad)).any().float())
        found = bool(found_inf_everywhere(self.ctx, local).item())
        self._decided = found if self._decided is None else (self._decided or found)
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if needed, then step unless some rank found an inf; returns whether the optimizer stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if self._decided:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Halve the scale after a skipped step; double it after `growth_interval` steps in a row without."""
        if not self.enabled:
            return
        if self._decided is None:
            raise RuntimeError("update() before step(): call scaler.step(optimizer) first")
        self.found_inf = self._decided
        self.history.append((self.scale_value, self.found_inf))
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self.scale_value *= self.growth_factor
                self._growth_tracker = 0
        self._unscaled.clear()
        self._decided = None
