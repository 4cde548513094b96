"""Figures of training runs on the digits: lesson 08's four models (positions × pre-norm) and lesson 09's scrambled
digit. Built without pyplot (`CourseFigure`), like every figure of `fsdp_course.viz`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from matplotlib.figure import Figure
from torch import nn

from fsdp_course.i18n.messages import catalogue, text
from fsdp_course.viz.style import CourseFigure

T = catalogue("viz.training")  # fsdp_course/i18n/catalogues/viz.training.yml

__all__ = ["plot_positions_prenorm", "plot_scrambled_digit"]

_STYLES = {(False, False): ("tab:red", "-"), (False, True): ("tab:orange", "--"),
           (True, False): ("tab:green", "--"), (True, True): ("tab:blue", "-")}


def plot_positions_prenorm(logs: Mapping[tuple[bool, bool], Mapping[str, Any]], bag: float,
                           classes: int = 10) -> Figure:
    """Training loss per step (left) and held-out accuracy after each epoch (right) of the runs
    `{(positional, pre_norm): log}`, with a uniform guess's loss, ln `classes`, and the accuracy `bag` of a
    logistic regression on the grey-level counts."""
    fig = CourseFigure(figsize=(11, 3.8), layout="constrained")
    ax_loss, ax_acc = fig.subplots(1, 2)
    for switches, log in logs.items():
        color, line = _STYLES[switches]
        name = text(T({(False, False): "no_post", (False, True): "no_pre", (True, False): "pos_post",
                       (True, True): "pos_pre"}[switches]))
        per_epoch = len(log["step_loss"]) // len(log["test_acc"])
        ax_loss.plot(range(1, len(log["step_loss"]) + 1), log["step_loss"], line, color=color, label=name)
        ax_acc.plot([per_epoch * (e + 1) for e in range(len(log["test_acc"]))], log["test_acc"], "o" + line,
                    color=color, label=name)
    ax_loss.axhline(math.log(classes), color="grey", linestyle=":", label=text(T("uniform", classes=classes)))
    ax_loss.set(xlabel=text(T("step")), ylabel=text(T("training_loss")), title=text(T("loss_title")))
    ax_acc.axhline(bag, color="grey", linestyle=":", label=text(T("bag")))
    ax_acc.set(xlabel=text(T("step")), ylabel=text(T("accuracy")), ylim=(0, 1), title=text(T("accuracy_title")))
    ax_loss.legend(fontsize=8)
    ax_acc.legend(fontsize=8, loc="upper left")
    fig.suptitle(text(T("ablation")))
    return fig


@torch.no_grad()
def plot_scrambled_digit(models: Sequence[nn.Module], image: torch.Tensor, perm: torch.Tensor, label: int) -> Figure:
    """A test digit (8 x 8 tokens) and the same pixels scrambled by `perm`, each titled with the classes that
    `models` (no positions, positions) predict for it."""
    fig = CourseFigure(figsize=(5.6, 3.0))
    axes = fig.subplots(1, 2)
    for ax, shown, title in ((axes[0], image, T("test_digit", label=label)), (axes[1], image[perm], T("scrambled"))):
        guesses = [model(shown.unsqueeze(0)).argmax().item() for model in models]
        ax.imshow(shown.reshape(8, 8), cmap="gray_r")
        ax.set_title(text(T("guesses", title=title, without=guesses[0], with_=guesses[1])), fontsize=9)
        ax.axis("off")
    return fig
