"""Messages a learner reads, by id, with their English and Chinese side by side in one catalogue per module.

`T = catalogue("common")` registers `catalogues/common.yml` (e.g. values_differ: en "rank {rank}: values differ",
zh "rank {rank}：数值不对") and returns `T`, which makes a `Message` from an id and its fields:
`T("values_differ", rank=1)`, rendered in either language.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["CATALOGUE", "Message", "catalogue", "fields_of", "text"]

CATALOGUE: dict[str, dict[str, str]] = {}  # "module.id" -> {"en": template, "zh": template}
_CJK = re.compile(r"[\u3400-\u9fff]")
CATALOGUES = Path(__file__).parent / "catalogues"  # <module>.yml: id -> {en: template, zh: template}


@dataclass(frozen=True)
class Message:
    """One catalogued message with its fields; `str()` is its English."""

    id: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    def render(self, lang: str) -> str:
        """The message in `lang` ("en" or "zh"); fields that are Messages render in the same language."""
        values = {k: v.render(lang) if isinstance(v, Message) else v for k, v in self.fields.items()}
        return CATALOGUE[self.id][lang].format(**values)

    @property
    def en(self) -> str:
        return self.render("en")

    @property
    def zh(self) -> str:
        return self.render("zh")

    def __str__(self) -> str:
        return self.en

    def __hash__(self) -> int:  # a Message can name a dict's entry (a figure's panel); equal Messages hash equal
        return hash((self.id, tuple(sorted(self.fields))))


def fields_of(template: str) -> set[str]:
    """The names of the fields `template` formats, e.g. {"rank", "n"} for "rank {rank}: {n:g}x"."""
    return {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(template) if name}


def catalogue(module: str, entries: Mapping[str, tuple[str, str]] | None = None) -> Callable[..., Message]:
    """Register `module`'s messages (id -> (English, Chinese); by default read from `catalogues/<module>.yml`) under
    `module.` and return the function that makes their Messages. Refuses (ValueError, at import) an entry without its
    Chinese, or whose two templates use other fields."""
    if entries is None:
        entries = _read(CATALOGUES / f"{module}.yml")
    for key, pair in entries.items():
        name = f"{module}.{key}"
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(s, str) and s for s in pair)):
            raise ValueError(f"message {name}: give (English, Chinese), two non-empty strings; got {pair!r}")
        en, zh = pair
        if _CJK.search(en) or not _CJK.search(zh):
            raise ValueError(f"message {name}: the first template is the English, the second the Chinese: {pair!r}")
        if fields_of(en) != fields_of(zh):
            raise ValueError(f"message {name}: the English uses fields {sorted(fields_of(en))}, the Chinese "
                             f"{sorted(fields_of(zh))}: both must fill the same ones")
        if name in CATALOGUE and CATALOGUE[name] != {"en": en, "zh": zh}:
            raise ValueError(f"message {name} is registered twice with different text")
        CATALOGUE[name] = {"en": en, "zh": zh}

    def make(key: str, /, **fields: Any) -> Message:
        name = f"{module}.{key}"
        if name not in CATALOGUE:
            raise KeyError(f"no message {name!r}: add it to the catalogue of {module}")
        missing = fields_of(CATALOGUE[name]["en"]) - set(fields)
        if missing:
            raise TypeError(f"message {name} needs the fields {sorted(missing)}")
        return Message(name, dict(fields))

    return make


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """YAML's safe loader, refusing an id given twice (plain YAML keeps the last)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        twice = sorted({str(k) for k in keys if keys.count(k) > 1})
        if twice:
            raise yaml.constructor.ConstructorError(None, None, f"message ids given twice: {', '.join(twice)}",
                                                    node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _read(path: Path) -> dict[str, tuple[str, str]]:
    """A catalogue file's entries; a ValueError naming the file and entry for anything but `id: {en: .., zh: ..}`."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: give one entry per message id, `id:` then `en:` and `zh:` lines; got {data!r}")
    entries = {}
    for key, value in data.items():
        if not isinstance(key, str):  # YAML reads `no:` or `on:` as a boolean
            raise ValueError(f"{path}: message id {key!r} is not read as text: put it in quotes")
        if not (isinstance(value, dict) and set(value) == {"en", "zh"}):
            raise ValueError(f"{path}: message {key} needs exactly an `en:` and a `zh:` template; got {value!r}")
        entries[key] = (value["en"], value["zh"])
    return entries


def text(what: Message | str) -> str:
    """What a figure writes: a Message in the figures' language (`fsdp_course.i18n.figure_language()`: the course's,
    English where no CJK font could show Chinese); a str, a name from code or data (rank 3, all_gather), as it is."""
    if isinstance(what, Message):
        from fsdp_course.i18n import figure_language

        return what.render(figure_language())
    return str(what)
