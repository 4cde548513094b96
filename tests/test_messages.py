"""Every problem and hint a checker shows is a catalogued message with its English and its Chinese.

The catalogue (fsdp_course/i18n/messages.py) refuses an entry without its Chinese or whose languages fill other
fields. The checkers' syntax trees are read for every call of a catalogue's function: each id exists, with the fields
its templates need, so a branch no planted mistake reaches cannot name a missing message; and no CheckFailure is given
a bare string. A report adds the Chinese under FSDP_COURSE_LANG=zh and stays English without it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import fsdp_course.classroom.checks as checks
from fsdp_course.classroom.checks._common import CheckFailed, CheckFailure, T
from fsdp_course.i18n.messages import CATALOGUE, Message, catalogue, fields_of

CHECKS = Path(checks.__file__).parent
CJK = re.compile(r"[\u4e00-\u9fff]")


def _makers(tree: ast.Module) -> dict[str, str]:
    """Names in a module bound to a catalogue's function -> the catalogue's name."""
    names = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "catalogue"):
            names[node.targets[0].id] = node.value.args[0].value
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("checks._common"):
            names.update({a.asname or a.name: "common" for a in node.names if a.name == "T"})
    return names


def _ids(node: ast.expr) -> list[str] | None:
    """The ids an id expression can give: a literal, either branch of `a if c else b`, any item of a literal tuple
    or dict that is indexed; None for anything else (a name, an f-string: unreadable here, so refused)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        body, orelse = _ids(node.body), _ids(node.orelse)
        return None if body is None or orelse is None else body + orelse
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Tuple | ast.List | ast.Dict):
        items = node.value.values if isinstance(node.value, ast.Dict) else node.value.elts
        ids = [_ids(item) for item in items]
        return None if any(i is None for i in ids) else [i for group in ids for i in group]  # type: ignore[union-attr]
    return None


def _calls(path: Path) -> list[tuple[int, str, str, set[str] | None]]:
    """(line, catalogue, id, keyword fields or None when passed as **kwargs) of each message made in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    makers = _makers(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in makers:
            ids = _ids(node.args[0])
            assert ids is not None, f"{path.name}:{node.lineno}: give the message id as a literal (or a literal table)"
            kwargs = None if any(k.arg is None for k in node.keywords) else {k.arg for k in node.keywords}
            found += [(node.lineno, makers[node.func.id], key, kwargs) for key in ids]
    return found


@pytest.mark.parametrize("path", sorted(CHECKS.glob("*.py")), ids=lambda p: p.name)
def test_every_message_a_checker_makes_is_catalogued_with_its_fields(path: Path) -> None:
    for line, module, key, kwargs in _calls(path):
        name = f"{module}.{key}"
        assert name in CATALOGUE, f"{path.name}:{line}: no message {name}"
        if kwargs is not None:
            assert kwargs == fields_of(CATALOGUE[name]["en"]), f"{path.name}:{line}: {name} takes other fields"


@pytest.mark.parametrize("path", sorted(CHECKS.glob("*.py")), ids=lambda p: p.name)
def test_no_checker_gives_a_failure_a_bare_string(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "CheckFailure":
            given = node.args[2:4] + [k.value for k in node.keywords if k.arg in ("problem", "hint")]
            for arg in given:
                assert not isinstance(arg, (ast.Constant, ast.JoinedStr, ast.BinOp)), \
                    f"{path.name}:{node.lineno}: a problem or hint is a Message of the module's catalogue"


@pytest.mark.parametrize("path", sorted(CHECKS.glob("*.py")), ids=lambda p: p.name)
def test_no_checker_prints_but_through_say(path: Path) -> None:
    """What passed is said in the learner's language by `_common.say`, one catalogued message per line: a `print` in a
    checker would speak English to a Chinese learner. Only `_common` prints (`say` itself, and a failure's report)."""
    if path.name == "_common.py":
        return
    tree = ast.parse(path.read_text(encoding="utf-8"))
    prints = [node.lineno for node in ast.walk(tree)
              if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"]
    assert not prints, f"{path.name}: print at lines {prints}: say(T(...)) instead, with the message catalogued"


def test_every_checker_module_has_its_messages_and_each_renders_in_both_languages() -> None:
    used = {module for path in CHECKS.glob("*.py") for _, module, _, _ in _calls(path)}
    assert {"common", "collectives", "hsdp", "budget", "dcp", "lora"} <= used
    for name, templates in CATALOGUE.items():
        values = dict.fromkeys(fields_of(templates["en"]), 2)
        assert not CJK.search(Message(name, values).en) and CJK.search(Message(name, values).zh), name
        assert "\\" not in templates["zh"] and not re.search(r"[，。：；] | [，。：；]", templates["zh"]), name


def test_the_catalogue_refuses_what_would_leave_a_learner_in_english() -> None:
    with pytest.raises(ValueError, match="two non-empty strings"):
        catalogue("t_missing", {"a": ("only English",)})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="the first template is the English"):
        catalogue("t_swapped", {"a": ("中文", "English")})
    with pytest.raises(ValueError, match=r"fields \['rank'\], the Chinese \[\]"):
        catalogue("t_fields", {"a": ("rank {rank} differs", "不一样")})
    make = catalogue("t_ok", {"a": ("rank {rank} differs", "rank {rank} 不一样")})
    with pytest.raises(ValueError, match="registered twice"):
        catalogue("t_ok", {"a": ("rank {rank} differs!", "rank {rank} 不一样")})
    with pytest.raises(TypeError, match=r"needs the fields \['rank'\]"):
        make("a")
    with pytest.raises(KeyError, match="no message 't_ok.b'"):
        make("b")
    with pytest.raises(TypeError, match="must be a Message"):
        CheckFailure("check_x", "world size 2", "rank 0: values differ", T("read_traceback"))  # type: ignore[arg-type]
    for name in [n for n in CATALOGUE if n.startswith("t_")]:
        del CATALOGUE[name]


def test_every_catalogue_file_is_read_and_a_bad_one_is_refused_by_name(tmp_path: Path) -> None:
    """Each `catalogues/<module>.yml` is registered (so checked) once the checkers and figures are imported; a file
    that YAML reads otherwise than `id: {en, zh}` is refused with its path and the entry."""
    import importlib
    import pkgutil

    import fsdp_course.viz as viz
    from fsdp_course.i18n import messages

    for module in pkgutil.iter_modules(viz.__path__):
        importlib.import_module(f"fsdp_course.viz.{module.name}")
    registered = {name.rsplit(".", 1)[0] for name in CATALOGUE}
    files = {path.stem for path in messages.CATALOGUES.glob("*.yml")}
    assert files and files <= registered, f"catalogues no module reads: {sorted(files - registered)}"
    for text, refusal in [("no:\n  en: a\n  zh: 甲\n", "put it in quotes"),
                          ("a:\n  en: only English\n", "exactly an `en:` and a `zh:`"),
                          ("- a list\n", "one entry per message id"),
                          ("a:\n  en: x\n  zh: 甲\na:\n  en: y\n  zh: 乙\n", "message ids given twice: a"),
                          ("a:\n  en: \"unclosed\n", "not valid YAML")]:
        (tmp_path / "t_file.yml").write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=refusal) as refused:
            messages._read(tmp_path / "t_file.yml")
        assert "t_file.yml" in str(refused.value)


def _averaging_all_reduce(ctx, tensor):  # a planted mistake: the mean where the sum is asked
    flat = torch.cat([tensor.reshape(-1), tensor.new_zeros(-tensor.numel() % ctx.world_size)])
    return ctx.all_gather(ctx.reduce_scatter(flat, op="mean"))[:tensor.numel()].reshape(tensor.shape)


@pytest.mark.parametrize("lang", ["zh", None])
def test_a_report_adds_its_chinese_only_in_chinese(lang: str | None, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    if lang is None:
        monkeypatch.delenv("FSDP_COURSE_LANG", raising=False)
    else:
        monkeypatch.setenv("FSDP_COURSE_LANG", lang)
    with pytest.raises(CheckFailed):
        checks.check_all_reduce(_averaging_all_reduce)
    out = capsys.readouterr().out
    assert "  hint: rank 0's result is 2x too small" in out
    if lang == "zh":
        assert "  问题：rank 0：数值不对\n" in out and "  提示：rank 0 的结果只有应得值的 1/2" in out
    else:
        assert not CJK.search(out), out


def test_equal_messages_hash_equal() -> None:
    make = catalogue("t_hash", {"n": ("{n} ranks", "{n} 个 rank")})
    assert make("n", n=1) == make("n", n=1.0) and hash(make("n", n=1)) == hash(make("n", n=1.0))
    assert {make("n", n=2): "panel"}[make("n", n=2)] == "panel"
    del CATALOGUE["t_hash.n"]
