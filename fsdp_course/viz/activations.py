"""Memory by kind against the batch size: the model state stays, the activations grow (lesson 03)."""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure

from fsdp_course.i18n.messages import Message, catalogue, text
from fsdp_course.viz.style import CATEGORY_COLORS, new_figure, word

__all__ = ["T", "plot_memory_by_batch"]

T = catalogue("viz.activations")  # fsdp_course/i18n/catalogues/viz.activations.yml



def plot_memory_by_batch(model_state: Mapping[str, int], activations: Mapping[int, int],
                         title: str | Message) -> Figure:
    """One stacked bar per batch size, in MiB: the parts of the model state (`{"params": bytes, "grads": ...}`, the
    same at every batch size), and on top the activations measured at that batch size (`{batch: bytes}`)."""
    fig, axes = new_figure(size=(7, 3.2))
    ax = axes[0, 0]
    for i, saved in enumerate(activations.values()):
        bottom = 0
        for name, value in [*model_state.items(), ("activations", saved)]:
            ax.bar(i, value / 2**20, bottom=bottom / 2**20, color=CATEGORY_COLORS.get(name, "#b0b0b0"),
                   label=word(name) if i == 0 else None)
            bottom += value
    ax.set_xticks(range(len(activations)), [text(T("batch", b=b)) for b in activations])
    ax.set_ylabel("MiB")
    ax.set_title(text(title))
    ax.legend()
    return fig
