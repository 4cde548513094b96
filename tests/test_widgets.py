"""Tests for fsdp_course.viz.widgets: the ZeRO calculator's readout and figure follow its controls."""

import base64

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

pytest.importorskip("ipywidgets")

from fsdp_course import viz  # noqa: E402
from fsdp_course.viz.widgets import BROWSER_SELECTORS, CSS_CLASSES, ZeroCalculator, format_count, zero_calculator  # noqa: E402

MEASURED = {"DDP": {"params": 4000, "grads": 4000, "optimizer": 8000},
            "FSDP": {"sharded_params": 1000, "sharded_grads": 1000, "optimizer": 2000}}


def measured_bars(calc):
    return [a for a in calc.figure().axes[0].get_children() if (a.get_gid() or "").startswith("measured:")]


def data_bytes(calc):
    return float(calc.readout.value.split('data-bytes="')[1].split('"')[0])


def test_format_count():
    assert [format_count(n) for n in (999, 1500, 7e9, 1.75e11)] == ["999", "1.50 K", "7.00 B", "175 B"]


def test_moving_a_slider_changes_the_readout_and_the_figure():
    calc = zero_calculator(numel=10**9, world_size=8)
    text, png = calc.readout_text(), bytes(calc.image.value)
    assert png.startswith(b"\x89PNG")
    assert "ZeRO-3 (16Ψ/N), Ψ = 1.00 B parameters, N = 8, Adam: 1.86 GiB per rank" in text
    assert data_bytes(calc) == 16 * 10**9 / 8

    calc.params_slider.value = 10**10  # what a user's drag does: set the value, observers redraw
    assert calc.readout_text() != text and bytes(calc.image.value) != png
    assert "Ψ = 10.0 B parameters" in calc.readout_text() and data_bytes(calc) == 16 * 10**10 / 8

    text, png = calc.readout_text(), bytes(calc.image.value)
    calc.world_slider.value = 64
    assert "N = 64" in calc.readout_text() and bytes(calc.image.value) != png and data_bytes(calc) == 16 * 10**10 / 64

    calc.optimizer_buttons.value = "sgd"
    assert data_bytes(calc) == 8 * 10**10 / 64
    calc.stage_buttons.value = 0
    assert data_bytes(calc) == 8 * 10**10 and "DDP (8Ψ)" in calc.readout_text()


def test_readout_matches_the_formula_for_every_stage():
    calc = ZeroCalculator(numel=2_000_000, world_size=4)
    for stage in range(4):
        calc.set(stage=viz.STAGES[stage])
        assert data_bytes(calc) == pytest.approx(viz.zero_bytes(2_000_000, 4, stage)["total"], abs=1)
        assert viz.zero_formula_text(stage) in calc.readout_text()


def test_measured_bars_only_at_the_measured_run():
    calc = zero_calculator(MEASURED, numel=1000, world_size=4)
    assert calc.params_slider.min <= 3  # the slider reaches the lesson's small model
    assert calc.at_measured_run() and len(measured_bars(calc)) == 6
    assert "measured in the lesson's run" in calc.readout_text()
    calc.set(world_size=8)
    assert not calc.at_measured_run() and measured_bars(calc) == []
    assert "press the button" in calc.readout_text()
    calc.reset_button.click()
    assert calc.at_measured_run() and calc.world_slider.value == 4


def test_saved_output_is_deterministic_and_has_a_static_png():
    a = zero_calculator(numel=10**9, world_size=8)
    b = zero_calculator(numel=10**9, world_size=8)
    bundle = a._repr_mimebundle_()
    assert bundle["text/plain"] == b._repr_mimebundle_()["text/plain"] == f"ZeroCalculator: {a.summary()}"
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    assert not any(type(w).__name__ == "Output" for w in a.children)


def test_controls_carry_css_classes_for_browser_tests():
    calc = zero_calculator()
    classes = {c for w in calc.children for c in w._dom_classes}
    assert set(CSS_CLASSES.values()) <= classes
    for selector in BROWSER_SELECTORS.values():
        assert selector.split()[0].lstrip(".") in classes
    assert calc.world_slider.options[0] == 1 and calc.world_slider.options[-1] == 1024
    assert calc.params_slider.min <= 6 and calc.params_slider.max >= 11  # 1M .. 100B


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="numel= and world_size="):
        zero_calculator(MEASURED)
    with pytest.raises(ValueError, match="unknown ZeRO stage"):
        zero_calculator({"ZeRO-9": 1}, numel=10, world_size=2)
    with pytest.raises(ValueError, match="optimizer"):
        zero_calculator(optimizer="lion")
    with pytest.raises(ValueError, match="world_size"):
        zero_calculator(world_size=2048)
    calc = zero_calculator()
    with pytest.raises(ValueError, match="not on the slider"):
        calc.set(world_size=9)


def test_the_calculator_speaks_chinese_in_a_chinese_kernel(monkeypatch):
    import re
    import string

    from fsdp_course.viz.widgets import TEXT

    fields = [sorted(f for _, f, _, _ in string.Formatter().parse(t) if f) for pair in TEXT.values() for t in pair]
    assert fields[0::2] == fields[1::2], "each text has the same fields in both languages"
    monkeypatch.setenv("FSDP_COURSE_LANG", "zh")
    calc = ZeroCalculator(MEASURED, numel=2000, world_size=4)
    shown = [calc.params_slider.description, calc.world_slider.description, calc.optimizer_buttons.description,
             calc.stage_buttons.description, calc.reset_button.description, *calc.optimizer_buttons._options_labels,
             calc.readout_text()]
    calc.set(numel=10**9)
    shown.append(calc.readout_text())
    names = {"Adam", "SGD", "DDP", "ZeRO", "KiB", "MiB", "GiB", "rank"}  # kept in the Chinese text as they are
    english = {w for s in shown for w in re.findall(r"[A-Za-z]{3,}", s)} - names
    assert not english, f"English left in the Chinese calculator: {sorted(english)}"
    assert "每个 rank" in shown[-1] and "参数量" in shown[0]
    assert repr(calc).startswith("ZeroCalculator: ZeRO-3 (16Ψ/N), Ψ = 1.00 B parameters"), "text/plain stays English"
