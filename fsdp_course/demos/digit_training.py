"""Training on the digits, the bookkeeping of lessons 08 and 09: logs, held-out scores, runs side by side, tables.

Lesson 08 writes the FSDP training loop itself (wrap, sampler, forward, backward, step) and hands its records to
an `EpochLog`: the step's loss averaged over the ranks (one small all-reduce), the training accuracy of each epoch
and the held-out accuracy after it, each summed over the ranks' slices (`held_out`). Runs that need no ranks
(`train_one_process`, `train_steps`) and the runner that trains several models side by side live here too.

A log is a dict: `step_loss` (one value per step), `train_acc` and `test_acc` (one per epoch; `train_acc` only
for FSDP runs), `predicted` ({class: how often} on the held-out set after the last epoch; FSDP runs).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.models import TransformerClassifier, TransformerConfig
from fsdp_course.runtime.context import RankContext
from fsdp_course.sampler import DistributedSampler, global_batch

__all__ = ["EpochLog", "batches", "format_accuracies", "format_log", "held_out", "logistic_accuracy",
           "small_post_norm", "steps_per_epoch", "train_in_threads", "train_one_process", "train_steps"]

K = TypeVar("K", bound=Hashable)


def steps_per_epoch(n_samples: int, world_size: int, batch_per_rank: int) -> int:
    """Full batches per epoch on every rank when a `DistributedSampler` splits `n_samples` over `world_size`."""
    return len(DistributedSampler(n_samples, world_size, 0)) // batch_per_rank


def batches(indices: Sequence[int], batch: int) -> list[torch.Tensor]:
    """`indices` cut into consecutive batches of `batch` (the last, shorter one dropped), as index tensors."""
    order = torch.as_tensor(list(indices))
    return [order[start:start + batch] for start in range(0, len(order) - batch + 1, batch)]


@torch.no_grad()
def held_out(model: nn.Module, ctx: RankContext, x_test: torch.Tensor, y_test: torch.Tensor,
             num_classes: int) -> tuple[float, dict[int, int]]:
    """Accuracy on the held-out set and how often each class was predicted: each rank scores one slice, and the
    counts are summed over the ranks (one all-reduce)."""
    xs = torch.tensor_split(x_test, ctx.world_size)[ctx.rank]
    ys = torch.tensor_split(y_test, ctx.world_size)[ctx.rank]
    predicted = model(xs).argmax(-1)
    counts = torch.cat([(predicted == ys).sum().reshape(1), torch.bincount(predicted, minlength=num_classes)]).double()
    ctx.all_reduce(counts)  # correct answers and predictions per class, summed over the ranks' slices
    per_class = {c: int(k) for c, k in enumerate(counts[1:].tolist()) if k}
    return (counts[0] / len(y_test)).item(), per_class


class EpochLog:
    """What a rank records while it trains: call `step` after every optimizer step, `epoch` after every epoch (it
    scores the model on the held-out set `x_test`, `y_test` of a `num_classes`-way task). The numbers are the same
    on every rank (all-reduced); rank 0 drives the progress bar `bar` (a tqdm, or None)."""

    def __init__(self, ctx: RankContext, x_test: torch.Tensor, y_test: torch.Tensor, num_classes: int,
                 bar: Any = None) -> None:
        self.ctx, self.bar = ctx, bar
        self.x_test, self.y_test, self.num_classes = x_test, y_test, num_classes
        self.step_loss: list[float] = []
        self.train_acc: list[float] = []
        self.test_acc: list[float] = []
        self.predicted: dict[int, int] = {}
        self._correct = torch.zeros(2, dtype=torch.float64)  # this epoch's correct answers and samples, this rank

    @property
    def steps(self) -> int:
        """Steps recorded so far."""
        return len(self.step_loss)

    def step(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> int:
        """Record one step: its loss, averaged over the ranks, and this rank's correct answers. Returns the steps."""
        self.step_loss.append(self.ctx.all_reduce(loss.detach().reshape(1), op="mean").item())
        self._correct += torch.tensor([(logits.argmax(-1) == y).sum().item(), len(y)], dtype=torch.float64)
        if self.bar is not None and self.ctx.rank == 0:
            self.bar.set_postfix(loss=f"{self.step_loss[-1]:.3f}", refresh=False)
            self.bar.update()
        return self.steps

    def epoch(self, model: nn.Module) -> None:
        """Close an epoch: its training accuracy over every rank's batches, then the held-out accuracy."""
        self.ctx.all_reduce(self._correct)
        self.train_acc.append((self._correct[0] / self._correct[1]).item())  # while training, over the epoch
        self._correct = torch.zeros(2, dtype=torch.float64)
        accuracy, self.predicted = held_out(model, self.ctx, self.x_test, self.y_test, self.num_classes)
        self.test_acc.append(accuracy)

    def summary(self) -> dict[str, Any]:
        """The log as a dict (see the module's docstring)."""
        return {"step_loss": self.step_loss, "train_acc": self.train_acc, "test_acc": self.test_acc,
                "predicted": self.predicted}


def format_log(name: str, log: Mapping[str, Any]) -> str:
    """A run's log, one line per epoch: mean training loss, training accuracy, held-out accuracy."""
    per_epoch = len(log["step_loss"]) // len(log["test_acc"])
    lines = [f"{name}: {len(log['step_loss'])} steps, {per_epoch} per epoch",
             "epoch   mean loss   train acc   held-out acc"]
    for e, (train_acc, test_acc) in enumerate(zip(log["train_acc"], log["test_acc"], strict=True)):
        loss = sum(log["step_loss"][e * per_epoch:(e + 1) * per_epoch]) / per_epoch
        lines.append(f"{e + 1:>5}   {loss:>9.3f}   {train_acc:>9.1%}   {test_acc:>12.1%}")
    return "\n".join(lines)


def format_accuracies(logs: Mapping[tuple[bool, bool], Mapping[str, Any]]) -> str:
    """The held-out accuracy after each epoch of the runs `{(positional, pre_norm): log}`, one row per run."""
    epochs = max(len(log["test_acc"]) for log in logs.values())
    lines = ["held-out accuracy after each epoch",
             f"{'positions':<11}{'LayerNorm':<11}" + "".join(f"{f'epoch {e + 1}':>10}" for e in range(epochs))]
    for (positional, pre_norm), log in logs.items():
        lines.append(f"{'yes' if positional else 'no':<11}{'pre' if pre_norm else 'post':<11}"
                     + "".join(f"{a:>10.1%}" for a in log["test_acc"]))
    return "\n".join(lines)


def logistic_accuracy(features: torch.Tensor, y: torch.Tensor, test_features: torch.Tensor,
                      y_test: torch.Tensor) -> float:
    """Held-out accuracy of a plain logistic regression (scikit-learn) fitted on `features` (samples x features):
    how much a linear model can read from those features alone."""
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # one BLAS thread: these fits are tiny, and more threads only slow them down
        fitted = LogisticRegression(max_iter=1000).fit(features.numpy(), y.numpy())
        return float(fitted.score(test_features.numpy(), y_test.numpy()))


def train_one_process(model: nn.Module, x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor,
                      y_test: torch.Tensor, *, epochs: int, batch: int, lr: float, bar: Any = None) -> dict[str, Any]:
    """AdamW on `model` in this process: every epoch shuffled by a one-rank `DistributedSampler` (seed 0), cut into
    batches of `batch`; the held-out accuracy after each epoch. Returns {"step_loss", "test_acc"}."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sampler = DistributedSampler(len(x), 1, 0, shuffle=True, seed=0)  # one rank: the whole epoch, shuffled
    log: dict[str, Any] = {"step_loss": [], "test_acc": []}
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for idx in batches(sampler.indices(), batch):
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            log["step_loss"].append(loss.item())
            if bar is not None:
                bar.update()
        with torch.no_grad():
            log["test_acc"].append((model(x_test).argmax(-1) == y_test).double().mean().item())
    return log


def small_post_norm(positional: bool = True, seed: int = 0) -> TransformerClassifier:
    """A small Transformer classifier of the article's kind of layer (post-norm, d_model 16, 2 heads, 1 layer) for
    the digits, with or without a learned positional embedding; built after `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    config = TransformerConfig.small(d_model=16, nhead=2, num_layers=1, positional=positional, pre_norm=False)
    return TransformerClassifier(config)


def train_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, *, batch: int = 32,
                lr: float = 1e-2, generator: torch.Generator | None = None) -> list[float]:
    """`steps` AdamW steps, each on the global batch `sampler.global_batch(len(x), batch, step)`, or, given a
    `generator`, on `batch` indices drawn from it uniformly (`torch.randint`, repeats allowed). The losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        if generator is None:
            idx = global_batch(len(x), batch, step)
        else:
            idx = torch.randint(0, len(x), (batch,), generator=generator)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_in_threads(runs: Mapping[K, Callable[[], Any]]) -> dict[K, Any]:
    """Call every independent run side by side, one thread per core at most; their results, in the runs' order.
    Build the models before (in the main thread, which owns the global random generator: lesson 00)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(runs), os.cpu_count() or 1))) as pool:
        running = {key: pool.submit(run) for key, run in runs.items()}
        return {key: future.result() for key, future in running.items()}
