"""The Chinese edition stays in step with the English one: catalogs, generated notebooks, figures, language choice.

The first test is the one an author meets: it fails when an English markdown cell changed since it was translated,
when a cell has no translation, or when a Chinese notebook is missing or out of date, and says what to run. The
rest check the machinery on a small course made in a temporary folder, and `fsdp_course.i18n` (which language,
figures that write their words in it, the CJK font and its fallback).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pkgutil
import re
import warnings
from pathlib import Path

import matplotlib
import nbformat
import pytest
import torch

from fsdp_course import i18n, viz
from fsdp_course.classroom import translations as tr

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]
PNG = "image/png"


def test_the_chinese_edition_is_in_step_with_the_english_one() -> None:
    problems = tr.status(ROOT)
    assert not problems, "\n".join(map(str, problems[:20])) + f"\n({len(problems)} in all)"


def test_every_notebook_has_a_chinese_twin_with_the_same_code_and_outputs() -> None:
    english = tr.english_notebooks(ROOT)
    assert len(english) >= 36
    for path in english:
        en, zh = nbformat.read(path, 4), nbformat.read(tr.target_path(path), 4)
        assert [c.id for c in en.cells] == [c.id for c in zh.cells], path.name
        for a, b in zip(en.cells, zh.cells, strict=True):
            if a.cell_type == "code":
                assert a.source == b.source, f"{path.name} [{a.id}]: code cells are never translated"
                assert [o.get("output_type") for o in a.outputs] == [o.get("output_type") for o in b.outputs]
            else:
                assert b.source and (a.source != b.source or a.cell_type != "markdown"
                                     or tr.load_catalog(tr.catalog_path(path, ROOT))[a.id].get("same")), a.id
        markdown = "".join(c.source for c in zh.cells if c.cell_type == "markdown")
        assert sum("\u4e00" <= ch <= "\u9fff" for ch in markdown) > 0.2 * len(markdown.split()), \
            f"{path.name}: the markdown of the Chinese notebook is not mostly Chinese"


def test_the_figures_of_a_chinese_lesson_are_its_own() -> None:
    redrawn = 0
    for path in tr.english_notebooks(ROOT):
        en, zh = nbformat.read(path, 4), nbformat.read(tr.target_path(path), 4)
        for a, b in zip(en.cells, zh.cells, strict=True):
            pairs = zip(a.get("outputs", []), b.get("outputs", []), strict=True)
            pictures = [(x["data"][PNG], y["data"][PNG]) for x, y in pairs if PNG in x.get("data", {})]
            for english_png, chinese_png in pictures:
                assert english_png != chinese_png, f"{path.name} [{a.id}]: the figure was not drawn again in Chinese"
                redrawn += 1
    assert redrawn >= 20


# --- the machinery, on a course of one lesson in a temporary folder ---------------------------------------------------

def _course(tmp_path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 01 · Sharding\n\nSee [the next lesson](02_next.ipynb).", id="m1"),
                nbformat.v4.new_code_cell("print(1 + 1)", id="c1",
                                          outputs=[nbformat.v4.new_output("stream", name="stdout", text="2\n")]),
                nbformat.v4.new_markdown_cell("Every rank keeps one chunk.", id="m2")]
    (tmp_path / "lessons").mkdir()
    (tmp_path / "exercises").mkdir()
    nbformat.write(nb, tmp_path / "lessons" / "01_sharding.ipynb")
    return tmp_path / "lessons" / "01_sharding.ipynb"


def _translate(catalog: Path, mapping: dict[str, str]) -> None:
    import yaml

    data = yaml.safe_load(catalog.read_text(encoding="utf-8"))
    for cell_id, zh in mapping.items():
        data["cells"][cell_id]["zh"] = zh
    catalog.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False), encoding="utf-8")


def _whats(root: Path) -> list[str]:
    return [p.what.split(":")[0] for p in tr.status(root)]


def _english_with_a_twin(path: Path) -> bool:
    """An English lesson or exercise that has a Chinese twin."""
    return path.suffix == ".ipynb" and path.parent.name != "zh" and (path.parent / "zh" / path.name).exists()


def test_a_chinese_reader_is_never_sent_to_an_english_notebook_that_has_a_chinese_twin() -> None:
    """From README.zh.md through every Chinese lesson and exercise: every link resolves, and no link, and no notebook
    path named in the text, leads to an English notebook whose Chinese twin exists."""
    import re

    texts = [(ROOT / "README.zh.md", (ROOT / "README.zh.md").read_text(encoding="utf-8"))]
    for kind in ("lessons", "exercises"):
        for path in sorted((ROOT / kind / "zh").glob("*.ipynb")):
            texts += [(path, c.source) for c in nbformat.read(path, 4).cells if c.cell_type == "markdown"]
    problems = []
    for path, text in texts:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            resolved = (path.parent / target).resolve()
            if not resolved.exists():
                problems.append(f"{path.relative_to(ROOT)}: link to {target}, which does not exist")
            elif _english_with_a_twin(resolved):
                problems.append(f"{path.relative_to(ROOT)}: link to the English {target}; its Chinese twin is "
                                f"{(resolved.parent / 'zh' / resolved.name).relative_to(ROOT)}")
        for named in re.findall(r"`((?:lessons|exercises)/[0-9A]\w*\.ipynb)`", text):
            if _english_with_a_twin(ROOT / named):
                twin = named.replace("/", "/zh/", 1)
                problems.append(f"{path.relative_to(ROOT)}: names the English `{named}`; say `{twin}`")
    assert not problems, "\n".join(problems)


def test_one_word_means_one_thing_in_the_chinese_edition() -> None:
    """i18n/zh/glossary.yml's refused variants appear nowhere in the Chinese markdown, the checkers' Chinese messages
    or the figures' Chinese text (outside `code`)."""
    import re

    import yaml

    import fsdp_course.classroom.checks  # noqa: F401  (registers the checkers' messages)
    for module in pkgutil.iter_modules(viz.__path__):  # and the figures'
        importlib.import_module(f"fsdp_course.viz.{module.name}")
    from fsdp_course.i18n.messages import CATALOGUE

    glossary = yaml.safe_load((ROOT / "i18n" / "zh" / "glossary.yml").read_text(encoding="utf-8"))
    terms, quoting = glossary["terms"], set(glossary["quoting"])
    assert len(terms) >= 10 and all(t["zh"] for t in terms)
    texts = [(f"{p.relative_to(ROOT)} [{cid}]", e["zh"]) for p in sorted((ROOT / "i18n" / "zh").glob("*/*.yml"))
             for cid, e in tr.load_catalog(p).items() if f"{p.relative_to(ROOT)} [{cid}]" not in quoting]
    texts += [(f"message {name}", templates["zh"]) for name, templates in CATALOGUE.items()]
    found = []
    for where, text in texts:
        prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
        for term in terms:
            for pattern in term.get("refuse", []):
                for m in re.finditer(pattern, prose):
                    found.append(f"{where}: {prose[max(0, m.start() - 12):m.end() + 12]!r}: say {term['zh']} "
                                 f"for {term['en']}")
        # a line break inside a Chinese sentence renders as a stray space
        found += [f"{where}: line break in {prose[m.start() - 8:m.end() + 8]!r}: join the lines"
                  for m in re.finditer(r"[\u4e00-\u9fff，。；：、]\n(?![\s\-\d|#>*`])[\u4e00-\u9fff]", prose)]
        found += [f"{where}: a space in {prose[m.start() - 8:m.end() + 8]!r}: Chinese words take none"
                  for m in re.finditer(r"[\u4e00-\u9fff] [\u4e00-\u9fff]", prose)]
    assert not found, "\n".join(found[:30]) + f"\n({len(found)} in all)"


def test_status_names_each_kind_of_problem_and_build_fixes_what_it_can(tmp_path: Path) -> None:
    lesson = _course(tmp_path)
    assert _whats(tmp_path) == ["missing catalog"]
    catalog = tr.template(lesson, tmp_path)
    assert catalog == tmp_path / "i18n" / "zh" / "lessons" / "01_sharding.yml"
    assert _whats(tmp_path) == ["untranslated", "untranslated"]  # the template holds the English, to be replaced
    _translate(catalog, {"m1": "# 01 · 分片\n\n见[下一课](02_next.ipynb)。", "m2": "每个 rank 保存一块。"})
    assert _whats(tmp_path) == ["broken link '02_next.ipynb' (seen from zh/)"]
    (tmp_path / "lessons" / "zh").mkdir()
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "lessons" / "zh" / "02_next.ipynb")
    assert _whats(tmp_path) == ["missing", "has no English notebook"]
    (tmp_path / "lessons" / "zh" / "02_next.ipynb").unlink()
    _translate(catalog, {"m1": "# 01 · 分片\n\n见 [README](../../README.md)。"})
    (tmp_path / "README.md").write_text("x")
    assert _whats(tmp_path) == ["missing"]

    tr.build_all(tmp_path, log=lambda _: None)
    assert tr.status(tmp_path) == []
    zh = nbformat.read(tmp_path / "lessons" / "zh" / "01_sharding.ipynb", 4)
    assert [c.source for c in zh.cells] == ["# 01 · 分片\n\n见 [README](../../README.md)。", "print(1 + 1)",
                                            "每个 rank 保存一块。"]
    assert zh.cells[1].outputs[0]["text"] == "2\n"

    en = nbformat.read(lesson, 4)  # the author edits the English: the translation is stale until brought in step
    en.cells[2].source = "Every rank keeps one chunk of the flat parameter."
    en.cells.insert(1, nbformat.v4.new_markdown_cell("A new paragraph.", id="m0"))
    nbformat.write(en, lesson)
    problems = tr.status(tmp_path)
    assert [(p.cell, p.what.split(":")[0]) for p in problems] == [("m0", "no translation"), ("m2", "stale")]
    assert tr.sha(en.cells[3].source) in problems[1].fix  # the new sha to record
    with pytest.raises(ValueError, match="stale"):
        tr.build(lesson, tmp_path, log=lambda _: None)
    tr.template(lesson, tmp_path)
    import yaml

    data = yaml.safe_load(catalog.read_text(encoding="utf-8"))
    assert list(data["cells"]) == ["m1", "m0", "m2"]  # in the notebook's order; the stale entry kept as it was
    data["cells"]["m2"] = {"sha": tr.sha(en.cells[3].source), "zh": "每个 rank 保存展平参数的一块。"}
    data["cells"]["m0"]["zh"] = "新的一段。"
    data["cells"]["gone"] = {"sha": "0" * 12, "zh": "旧的"}
    catalog.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    assert _whats(tmp_path) == ["orphan"]
    del data["cells"]["gone"]
    catalog.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    assert _whats(tmp_path) == ["out of date with its English notebook or catalog"]
    tr.build_all(tmp_path, log=lambda _: None)
    assert tr.status(tmp_path) == []


def test_a_bad_catalog_is_named(tmp_path: Path) -> None:
    lesson = _course(tmp_path)
    catalog = tr.catalog_path(lesson, tmp_path)
    catalog.parent.mkdir(parents=True)
    catalog.write_text("cells:\n  m1: [not, a, mapping\n", encoding="utf-8")
    (problem,) = tr.status(tmp_path)
    assert problem.what == "unreadable" and "not valid YAML" in problem.fix
    catalog.write_text("cells:\n  m1:\n    zh: no sha\n", encoding="utf-8")
    (problem,) = tr.status(tmp_path)
    assert "entry 'm1' needs `sha:`" in problem.fix
    with pytest.raises(SystemExit):  # argparse's error: "not an English notebook (e.g. lessons/03_memory.ipynb)"
        tr.main(["template", str(tmp_path / "nope.ipynb")])


def test_a_figure_is_drawn_again_in_chinese_and_only_when_its_english_changed(tmp_path: Path) -> None:
    if i18n.cjk_font() is None:
        pytest.skip("no CJK font on this machine: its figures stay English (sudo apt-get install fonts-wqy-microhei)")
    lesson = _course(tmp_path)
    nb = nbformat.read(lesson, 4)
    nb.cells.append(nbformat.v4.new_code_cell(
        "from fsdp_course.viz.collectives import plot_ring_cost\nplot_ring_cost(4)", id="fig"))
    nb.cells.insert(-1, nbformat.v4.new_code_cell("from fsdp_course.i18n import language\nprint(language())", id="lang",
                                                  metadata={"tags": [tr.LOCALIZED]}))
    nbformat.write(nb, lesson)
    from fsdp_course.classroom.notebooks import run_notebook

    run_notebook(lesson)  # the English figure
    tr.template(lesson, tmp_path)
    _translate(tr.catalog_path(lesson, tmp_path), {"m1": "# 01 · 分片", "m2": "每个 rank 保存一块。"})
    logs: list[str] = []
    tr.build_all(tmp_path, log=logs.append)
    assert any("re-drawing 2 cell(s)" in line for line in logs)  # the figure's and the localized cell's
    said = [nbformat.read(p, 4).cells[-2].outputs[0]["text"] for p in (lesson, tr.target_path(lesson))]
    assert said == ["en\n", "zh\n"]  # the localized cell's output comes from the Chinese run
    cells = len(nbformat.read(lesson, 4).cells)  # the localized cell is the last but one, the figure the last
    before = tr._figure_shas(nbformat.read(lesson, 4), tmp_path)
    catalog = tr.catalog_path(lesson, tmp_path)
    catalog.write_text(catalog.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    after = tr._figure_shas(nbformat.read(lesson, 4), tmp_path)
    assert before[cells - 2] != after[cells - 2], "a localized output is run again when a catalog changes"
    assert before[cells - 1] == after[cells - 1] != [], "a figure is not"
    assert [p.cell for p in tr.status(tmp_path)] == ["lang"]  # status says the localized cell is due
    tr.build_all(tmp_path, log=logs.append)
    english = nbformat.read(lesson, 4).cells[-1].outputs
    chinese = nbformat.read(tr.target_path(lesson), 4).cells[-1].outputs
    png = [o["data"]["image/png"] for o in english if "image/png" in o.get("data", {})]
    png_zh = [o["data"]["image/png"] for o in chinese if "image/png" in o.get("data", {})]
    assert len(png) == len(png_zh) == 1 and png != png_zh
    assert tr.status(tmp_path) == []
    logs.clear()
    tr.build_all(tmp_path, log=logs.append)  # nothing changed: nothing re-drawn, nothing written
    assert logs == []


# --- fsdp_course.i18n ------------------------------------------------------------------------------------------------

def test_the_language_comes_from_the_variable_or_the_notebook_folder(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSDP_COURSE_LANG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert i18n.language() == "en"
    (tmp_path / "lessons" / "zh").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "lessons" / "zh")
    assert i18n.language() == "zh"
    monkeypatch.setenv("FSDP_COURSE_LANG", "en")
    assert i18n.language() == "en"
    monkeypatch.chdir(tmp_path)
    for value, lang in [("zh", "zh"), ("zh_CN", "zh"), ("zh-CN.UTF-8", "zh"), ("EN", "en")]:
        monkeypatch.setenv("FSDP_COURSE_LANG", value)
        assert i18n.language() == lang
    monkeypatch.setenv("FSDP_COURSE_LANG", "fr")
    with pytest.warns(UserWarning, match="not a language of the course"):
        i18n._warned.clear()
        assert i18n.language() == "en"


CODE_NAMES = re.compile(  # what a figure writes as it is in both languages: names from code and data, formulas
    r"(rank \d+|ranks [\d, ]+|(all_gather|all_reduce|reduce_scatter)(, N=\d+)?|broadcast|op='\w+'|DDP|FSDP|ZeRO-\d|"
    r"[\w.]*(weight|bias)( \([\d, ]*\))?|(encoder\.)?layers\.\d+|root|[\d.,]+ ?(B|KiB|MiB|GiB|TiB)|unshard|reshard|"
    r"[\w.]+: \w+ [\w.]+|\$.*\$|[\d/ ,()\[\]x.+=-]+|[\w-]+\n[\dΨ/N +]+|step \d+|\(no label\)|KiB|MiB|GiB)")


def _figures() -> list:
    """One figure of each of fsdp_course.viz's kinds, from small hand-made data."""
    from fsdp_course.fsdp.param_group import Span
    from fsdp_course.runtime.cost_model import CostFit, Sample
    from fsdp_course.runtime.ledger import Record
    from fsdp_course.viz import overlap, timeline
    from fsdp_course.viz.activations import T as TITLES
    from fsdp_course.viz.activations import plot_memory_by_batch
    from fsdp_course.viz.collectives import STAGE, plot_alpha_beta, plot_ring_cost, show_ranks
    from fsdp_course.viz.sharding import plot_per_param_sharding
    from fsdp_course.viz.training import plot_positions_prenorm, plot_scrambled_digit
    from fsdp_course.viz.units import plot_unit_tradeoff
    from fsdp_course.viz.zero_scaling import plot_zero_over_n

    step = [("init", {"params": 400}), ("forward: unshard root", {"sharded_params": 100, "gathered_params": 400}),
            ("forward done", {"sharded_params": 100}), ("post_backward: reduce_scatter root",
                                                         {"sharded_params": 100, "sharded_grads": 100}),
            ("optimizer step", {"sharded_params": 100, "sharded_grads": 100, "optimizer": 200})]
    record = Record(op="all_gather", seq=1, dtype="float32", shapes=((50,),), payload_bytes=400, sent_bytes=200,
                    recv_bytes=200, label="step 0", start=0.0, end=0.002)
    with contextlib.redirect_stdout(io.StringIO()):
        figures = [show_ranks(STAGE("rs_then_ag"), (STAGE("before"), [[1, 2], [3, 4]]), ("all_gather", [[4], [6]])),
                   plot_ring_cost(8)]
    figures += [viz.plot_sharding(["w", "b"], [6, 3], 2), viz.plot_memory_timeline([step, step]),
                viz.plot_memory_timeline([step, step], kind="lines"),
                viz.plot_memory_compare({timeline.T("one_unit"): [step], timeline.T("per_layer"): [step]},
                                        kind="stack", title=timeline.T("rank_of", rank=0, n=2)),
                viz.plot_overlap([([Span("layers.0", "forward", 0.001, 0.003)], [record])],
                                 title=overlap.T("fsdp_step", prefetch=1, n=2, step=0)),
                viz.plot_traffic([record], 400, 2), viz.plot_zero_bars(1000, 4, measured={"ZeRO-3": 4000}),
                plot_zero_over_n(1000, {"DDP": {1: 16000}}),
                plot_memory_by_batch({"params": 2**20}, {8: 2**20}, TITLES("one_process", psi=1)),
                plot_positions_prenorm({(False, False): {"step_loss": [2.3, 2.0], "test_acc": [0.3]}}, 0.5)]
    cost = CostFit(alpha=1e-4, beta=1e-9, r2=1.0, rms=0.0, median_ratio=1.0, worst_ratio=1.0, samples=2)
    figures += [plot_alpha_beta([Sample("all_reduce", 2, 4096, 2e-3), Sample("reduce_scatter", 2, 4096, 1e-3)], cost),
                plot_per_param_sharding(["enc.a.weight", "enc.a.bias"], [(4, 2), (4,)], 2),
                plot_unit_tradeoff(10**8, 4, cost, 10**6),
                plot_scrambled_digit([torch.nn.Linear(64, 10)] * 2, torch.rand(64), torch.randperm(64), 3)]
    return figures


def _texts(fig: object) -> list[str]:
    import matplotlib.text

    fig.canvas.draw()  # tick labels exist once drawn
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip()]


def test_figures_write_their_words_in_the_course_language(monkeypatch: pytest.MonkeyPatch) -> None:
    """In Chinese every word a figure writes is Chinese, except names from code and data; in English, none is."""
    if i18n.cjk_font() is None:
        pytest.skip("no CJK font on this machine: figures keep English (test_without_a_cjk_font_figures_stay_english)")
    monkeypatch.setitem(matplotlib.rcParams, "font.family", list(matplotlib.rcParams["font.family"]))
    monkeypatch.setenv("FSDP_COURSE_LANG", "zh")
    chinese = [text for fig in _figures() for text in _texts(fig)]
    english_left = sorted({t for t in chinese if re.search(r"[A-Za-z]{2}", t) and not re.search(r"[\u4e00-\u9fff]", t)
                           and not CODE_NAMES.fullmatch(t)})
    assert not english_left, f"figure text with no Chinese: {english_left}"
    assert sum(bool(re.search(r"[\u4e00-\u9fff]", t)) for t in chinese) >= 40
    monkeypatch.setenv("FSDP_COURSE_LANG", "en")
    assert not [t for fig in _figures() for t in _texts(fig) if re.search(r"[\u4e00-\u9fff]", t)]


def test_a_cjk_font_shows_the_chinese(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(matplotlib.rcParams, "font.family", list(matplotlib.rcParams["font.family"]))
    if i18n.cjk_font() is None:
        pytest.skip("no CJK font on this machine: see test_without_a_cjk_font_figures_stay_english")
    assert i18n.use_chinese_figures()
    monkeypatch.setenv("FSDP_COURSE_LANG", "zh")
    fig = viz.plot_sharding(["w", "b"], [6, 3], 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Glyph ... missing from font(s)": the CJK font takes the Chinese
        fig.canvas.draw()
    assert re.search(r"[\u4e00-\u9fff]", fig.axes[0].get_xlabel())


def test_without_a_cjk_font_figures_stay_english(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(i18n, "cjk_font", lambda: None)
    i18n._warned.clear()
    with pytest.warns(UserWarning, match="no Chinese font found.*fonts-noto-cjk"):
        assert i18n.use_chinese_figures() is False
    monkeypatch.setenv("FSDP_COURSE_LANG", "zh")
    from fsdp_course.i18n.messages import text
    from fsdp_course.viz.overlap import T

    assert text(T("title")) == "Compute and communication per rank over one step"  # English labels, not boxes


@pytest.mark.parametrize("argv, env, lesson", [
    ([], None, "lessons/00_welcome.ipynb"),
    (["--lang", "zh"], None, "lessons/zh/00_welcome.ipynb"),
    ([], "zh_CN", "lessons/zh/00_welcome.ipynb"),
    (["--lang", "en"], "zh", "lessons/00_welcome.ipynb"),
])
def test_make_lab_zh_opens_the_chinese_edition(argv: list[str], env: str | None, lesson: str,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_course.classroom import lab

    class Started(Exception):
        pass

    def execv(path: str, cmd: list[str]) -> None:
        raise Started(cmd)

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(lab.os, "execv", execv)
    monkeypatch.setattr(lab, "install_settings", lambda: None)
    if env is None:
        monkeypatch.delenv("FSDP_COURSE_LANG", raising=False)
    else:
        monkeypatch.setenv("FSDP_COURSE_LANG", env)
    with pytest.raises(Started) as started:
        lab.main([*argv, "--no-browser", "--port", "0"])
    assert f"--LabApp.default_url=/lab/tree/{lesson}" in started.value.args[0]
    assert f"/lab/tree/{lesson}?token=" in capsys.readouterr().out


def test_a_localized_cell_prints_in_the_readers_language() -> None:
    """Lesson 00's course map is tagged `localized`: the Chinese twin keeps what the Chinese run printed (titles of the
    Chinese notebooks), the English notebook the English; nbval checks both against a fresh run."""
    outputs = {}
    for path in (ROOT / "lessons" / "00_welcome.ipynb", ROOT / "lessons" / "zh" / "00_welcome.ipynb"):
        cell = next(c for c in nbformat.read(path, 4).cells if tr.LOCALIZED in c.metadata.get("tags", []))
        outputs[path.parent.name] = "".join(o.get("text", "") for o in cell.outputs)
    assert "01  Collectives: broadcast" in outputs["lessons"] and not re.search(r"[\u4e00-\u9fff]", outputs["lessons"])
    assert "01  集合通信" in outputs["zh"] and "练习" in outputs["zh"]
