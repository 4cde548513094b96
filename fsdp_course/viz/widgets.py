"""The ZeRO memory calculator as an ipywidgets control: sliders in, bytes per rank and bars out.

Kept apart from `viz.py` so that the core library imports without Jupyter. The numbers are ZeRO's
model-state accounting (arXiv:1910.02054, section 5.1; fp32 with Adam: DDP 16 Psi, ZeRO-1 8 Psi + 8 Psi/N,
ZeRO-2 4 Psi + 12 Psi/N, ZeRO-3 / FSDP 16 Psi/N, FSDP as in arXiv:2304.11277), computed by
`viz.zero_bytes` and drawn by `viz.plot_zero_bars`, with the bytes measured in a lesson beside them.

Built to survive nbval and to show up where no kernel runs:
  - no `Output` widget (nbval cannot compare it): the figure is re-drawn into an `Image` widget as PNG;
  - the saved text/plain is a short deterministic summary, not the widget tree with its PNG bytes;
  - the display bundle also carries the figure as image/png, a static fallback for headless runs.
Browser tests find the controls by the CSS classes in `CSS_CLASSES`; `BROWSER_SELECTORS` holds the
selectors checked in headless JupyterLab 4 (chromium + playwright): focus the world-size slider's handle
and press ArrowRight (next N), or click the parameters slider's readout, select all, type "1e10" and
Enter; the readout's text, and its `data-bytes` (bytes per rank), change. Python tests call `set(...)`
or assign a control's `.value`.
"""

from __future__ import annotations

import base64
import functools
import io
import math
import re
from collections.abc import Mapping
from typing import Any

import ipywidgets as widgets
from matplotlib.figure import Figure

from fsdp_course.i18n import language
from fsdp_course.viz import STAGES, format_bytes, plot_zero_bars, stage_index, zero_bytes, zero_formula_text

__all__ = ["BROWSER_SELECTORS", "CSS_CLASSES", "OPTIMIZERS", "ZeroCalculator", "format_count", "zero_calculator"]

# Every text the calculator shows, by id, in English and Chinese: the language is fsdp_course.i18n.language() at
# the calculator's construction (a kernel started in a zh/ folder, or FSDP_COURSE_LANG=zh, speaks Chinese).
TEXT = {
    "params": ("parameters Ψ", "参数量 Ψ"),
    "world_size": ("world size N", "进程数 N"),
    "optimizer": ("optimizer", "优化器"),
    "stage": ("stage", "阶段"),
    "back": ("back to the lesson's run", "回到本课实测的配置"),
    "reset": ("reset", "重置"),
    "adam": ("Adam", "Adam"),
    "sgd_momentum": ("SGD with momentum", "带动量的 SGD"),
    "sgd": ("SGD", "SGD"),
    "summary": ("{stage} ({formula}), Ψ = {psi} parameters, N = {n}, {optimizer}: {bytes} per rank",
                "{stage}（{formula}），Ψ = {psi} 个参数，N = {n}，{optimizer}：每个 rank {bytes}"),
    "part_params": ("params", "参数"), "part_grads": ("grads", "梯度"),
    "part_optimizer": ("optimizer", "优化器状态"), "part_gathered": ("gathered", "聚合的参数"),
    "ddp": ("DDP would need {bytes} per rank, {ratio:.2f}x as much.",
            "DDP 每个 rank 需要 {bytes}，是它的 {ratio:.2f} 倍。"),
    "hatched": ("Hatched bars: bytes measured in the lesson's run.", "带斜线的柱：本课实测的字节数。"),
    "elsewhere": ("The measured bars belong to Ψ = {psi}, N = {n}, {optimizer}: press the button to compare.",
                  "实测的柱属于 Ψ = {psi}，N = {n}，{optimizer}：按下上面的按钮即可对比。"),
}

OPTIMIZERS = tuple((TEXT[v][0], v) for v in ("adam", "sgd_momentum", "sgd"))  # (English label, value)


def text(key: str, lang: str = "en", **fields: Any) -> str:
    """The calculator's text `key` in `lang` ("en" or "zh"), its fields filled in."""
    return TEXT[key][lang == "zh"].format(**fields)
WORLD_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
CSS_CLASSES = {"params": "fsdp-zero-params", "world_size": "fsdp-zero-world-size",
               "optimizer": "fsdp-zero-optimizer", "stage": "fsdp-zero-stage", "readout": "fsdp-zero-readout",
               "figure": "fsdp-zero-figure", "reset": "fsdp-zero-reset"}
BROWSER_SELECTORS = {
    "world_size_handle": ".fsdp-zero-world-size .noUi-handle",  # focus, then ArrowRight / ArrowLeft
    "params_readout": ".fsdp-zero-params .widget-readout",  # editable: click, Control+a, type, Enter
    "readout": ".fsdp-zero-readout",  # innerText: the summary, the parts, the DDP comparison
    "readout_bytes": ".fsdp-zero-readout [data-bytes]",  # attribute data-bytes: bytes per rank
    "figure": ".fsdp-zero-figure",  # <img> with the PNG
}


def format_count(n: float) -> str:
    """1_500_000 -> '1.50 M' (K, M, B = billion, T)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:#.3g} {unit}"
    return f"{n:.0f}"


def _png(fig: Figure, dpi: int) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


class ZeroCalculator(widgets.VBox):
    """Sliders for Psi and N, buttons for optimizer and stage, a readout and the bars of all four stages.

    `measured`: {"DDP": bytes or a memory.measure() snapshot, "ZeRO-1": ..., "FSDP": ...}, measured for
    `numel` parameters on `world_size` ranks (both required with it); the measured bars are drawn
    whenever the controls are at that configuration (the "back to the lesson's run" button returns there).
    """

    def __init__(self, measured: Mapping[Any, Any] | None = None, *, numel: int | None = None,
                 world_size: int | None = None, optimizer: str = "adam", stage: int | str = "ZeRO-3",
                 bytes_per_param: int = 4, gathered_numel: int = 0, dpi: int = 80) -> None:
        if measured is not None and (numel is None or world_size is None):
            raise ValueError("measured bytes belong to one run: pass numel= and world_size= of that run too")
        numel = int(numel if numel is not None else 1_000_000_000)
        world_size = int(world_size if world_size is not None else 8)
        if numel < 1 or not 1 <= world_size <= 1024:
            raise ValueError(f"need numel >= 1 and 1 <= world_size <= 1024, got {numel}, {world_size}")
        if optimizer not in dict(OPTIMIZERS).values():
            raise ValueError(f"optimizer must be one of {[v for _, v in OPTIMIZERS]}, got {optimizer!r}")
        for key in measured or {}:
            stage_index(key)  # a clear error for an unknown stage name, now rather than at the first redraw
        self.measured = dict(measured) if measured is not None else None
        self.home = (numel, world_size, optimizer)
        self.bytes_per_param, self.gathered_numel, self.dpi = bytes_per_param, gathered_numel, dpi
        self.lang = language()
        t = functools.partial(text, lang=self.lang)
        wide = {"description_width": "initial"}
        self.params_slider = widgets.FloatLogSlider(
            value=numel, base=10, min=min(6, math.floor(math.log10(numel))), max=max(11, math.log10(numel)),
            step=0.01, description=t("params"), readout_format=".3s", continuous_update=False, style=wide,
            layout=widgets.Layout(width="520px"))
        self.world_slider = widgets.SelectionSlider(
            options=sorted(set(WORLD_SIZES) | {world_size}), value=world_size, description=t("world_size"),
            continuous_update=False, style=wide, layout=widgets.Layout(width="520px"))
        buttons = {"description_width": "initial", "button_width": "170px"}
        self.optimizer_buttons = widgets.ToggleButtons(options=[(t(v), v) for _, v in OPTIMIZERS], value=optimizer,
                                                       description=t("optimizer"), style=buttons)
        self.stage_buttons = widgets.ToggleButtons(options=[(s, i) for i, s in enumerate(STAGES)],
                                                   value=stage_index(stage), description=t("stage"), style=buttons)
        self.reset_button = widgets.Button(description=t("back") if measured else t("reset"),
                                           layout=widgets.Layout(width="200px"))
        self.readout = widgets.HTML()
        self.image = widgets.Image(format="png", layout=widgets.Layout(width=f"{8 * dpi}px"))  # 8-inch figure
        controls = (self.params_slider, self.world_slider, self.optimizer_buttons, self.stage_buttons)
        for key, w in zip(("params", "world_size", "optimizer", "stage", "reset", "readout", "figure"),
                          (*controls, self.reset_button, self.readout, self.image), strict=True):
            w.add_class(CSS_CLASSES[key])
        super().__init__(children=[*controls, self.reset_button, self.readout, self.image])
        self._quiet = False  # set() moves several controls, then redraws once
        for w in controls:
            w.observe(self._refresh, names="value")
        self.reset_button.on_click(lambda _: self.set(*self.home))
        self._refresh()

    # ------------------------------------------------------------ state
    @property
    def numel(self) -> int:
        return int(round(self.params_slider.value))

    def at_measured_run(self) -> bool:
        """True when the controls are at the configuration the measured bytes belong to."""
        return self.measured is not None and (self.numel, self.world_slider.value,
                                              self.optimizer_buttons.value) == self.home

    def bytes_per_rank(self) -> dict[str, float]:
        """The formula's bytes per rank for the current controls."""
        return zero_bytes(self.numel, self.world_slider.value, self.stage_buttons.value,
                          optimizer=self.optimizer_buttons.value, bytes_per_param=self.bytes_per_param,
                          gathered_numel=self.gathered_numel)

    def set(self, numel: float | None = None, world_size: int | None = None, optimizer: str | None = None,
            stage: int | str | None = None) -> ZeroCalculator:
        """Move the controls as a user would (for tests and lessons); the readout and figure follow."""
        if world_size is not None and world_size not in self.world_slider.options:
            raise ValueError(f"world size {world_size} is not on the slider {self.world_slider.options}")
        if optimizer is not None and optimizer not in dict(OPTIMIZERS).values():
            raise ValueError(f"optimizer must be one of {[v for _, v in OPTIMIZERS]}, got {optimizer!r}")
        self._quiet = True
        try:
            for w, v in ((self.params_slider, numel), (self.world_slider, world_size),
                         (self.optimizer_buttons, optimizer),
                         (self.stage_buttons, None if stage is None else stage_index(stage))):
                if v is not None:
                    w.value = v
        finally:
            self._quiet = False
        self._refresh()
        return self

    # ------------------------------------------------------------ output
    def summary(self, lang: str = "en") -> str:
        """One plain line: stage, formula, Psi, N, optimizer and the bytes per rank. English by default: it is also
        the calculator's text/plain, a saved output that the Chinese edition copies as it is; the readout a learner
        sees is in the calculator's language."""
        s, opt = self.stage_buttons.value, self.optimizer_buttons.value
        return text("summary", lang, stage=STAGES[s], formula=zero_formula_text(s, opt, self.bytes_per_param),
                    psi=format_count(self.numel), n=self.world_slider.value, optimizer=text(opt, lang),
                    bytes=format_bytes(self.bytes_per_rank()["total"]))

    def readout_text(self) -> str:
        """The readout without its HTML tags."""
        return re.sub(r"<[^>]+>", "", self.readout.value.replace("<br>", "\n"))

    def figure(self) -> Figure:
        """The bars for the current controls as a static figure (measured bars at the lesson's run)."""
        return plot_zero_bars(self.numel, self.world_slider.value,
                              self.measured if self.at_measured_run() else None,
                              optimizer=self.optimizer_buttons.value, bytes_per_param=self.bytes_per_param,
                              gathered_numel=self.gathered_numel, highlight=self.stage_buttons.value)

    def _refresh(self, change: Any = None) -> None:
        if self._quiet:
            return
        f = self.bytes_per_rank()
        lines = [f"<b>{self.summary(self.lang)}</b>"]
        parts = [f"{text('part_' + c, self.lang)} {format_bytes(f[c])}"
                 for c in ("params", "grads", "optimizer", "gathered") if f[c]]
        if parts:
            lines.append("= " + " + ".join(parts))
        if self.stage_buttons.value > 0 and f["total"]:
            ddp = zero_bytes(self.numel, self.world_slider.value, 0, optimizer=self.optimizer_buttons.value,
                             bytes_per_param=self.bytes_per_param)["total"]
            lines.append(text("ddp", self.lang, bytes=format_bytes(ddp), ratio=ddp / f["total"]))
        if self.measured is not None and self.at_measured_run():
            lines.append(text("hatched", self.lang))
        elif self.measured is not None:
            numel, n, opt = self.home
            lines.append(text("elsewhere", self.lang, psi=format_count(numel), n=n, optimizer=text(opt, self.lang)))
        self.readout.value = f'<div data-bytes="{f["total"]:.0f}">' + "<br>".join(lines) + "</div>"
        self.image.value = _png(self.figure(), self.dpi)

    def __repr__(self) -> str:
        return f"ZeroCalculator: {self.summary()}"

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/plain"] = repr(self)
        bundle["image/png"] = base64.b64encode(self.image.value).decode("ascii")  # static fallback
        return bundle


def zero_calculator(measured: Mapping[Any, Any] | None = None, **kwargs: Any) -> ZeroCalculator:
    """The calculator widget; see `ZeroCalculator` for the arguments. Display it as a cell's last value."""
    return ZeroCalculator(measured, **kwargs)
