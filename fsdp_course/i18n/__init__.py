"""The language the course speaks (English or Chinese), and the Chinese of its figures.

`language()` is "zh" when `FSDP_COURSE_LANG` says so (`zh`, `zh_CN`, ...), or, with the variable unset, when the
kernel runs in a Chinese notebook's folder (`lessons/zh/`, `exercises/zh/`: Jupyter starts a notebook's kernel
there); otherwise "en". `FSDP_COURSE_LANG=en` keeps everything English anywhere.

In Chinese, `import fsdp_course` makes every matplotlib figure translate its text as it is drawn (titles, axis
labels, legends, annotations; `fsdp_course/i18n/zh.py` holds the strings and patterns), in a CJK font found on the
machine. Without one, figures keep their English labels and one warning says which package to install. Code is
never translated: the Chinese notebooks run the English code cells unchanged, which is why the translation happens
at draw time. What checkers say is catalogued by id with its Chinese beside the English (`i18n/messages.py`).
"""

from __future__ import annotations

import os
import re
import warnings
from functools import cache, wraps
from pathlib import Path
from typing import Any

__all__ = ["cjk_font", "language", "translate", "use_chinese_figures"]

LANGUAGES = ("en", "zh")
# CJK fonts that a Debian package, macOS, Windows or a PyPI package provides, in order of preference
CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans SC", "Source Han Sans SC", "WenQuanYi Micro Hei", "WenQuanYi Zen Hei",
             "PingFang SC", "Heiti SC", "Hiragino Sans GB", "Microsoft YaHei", "SimHei", "Sarasa Gothic SC",
             "Noto Sans Mono CJK SC", "AR PL UMing CN")
INSTALL_FONT = ("Install one and restart the kernel: Debian/Ubuntu `sudo apt install fonts-noto-cjk` (or the smaller "
                "fonts-wqy-microhei), Fedora `sudo dnf install google-noto-sans-cjk-fonts`, conda "
                "`conda install -c conda-forge font-ttf-noto-cjk`, or `pip install mplfonts` then `mplfonts init`; "
                "macOS and Windows have one already (PingFang SC, Microsoft YaHei)")
INSTALL_FONT_ZH = ("安装一个中文字体后重启内核：Debian/Ubuntu 用 `sudo apt install fonts-noto-cjk`（或更小的 "
                   "fonts-wqy-microhei），Fedora 用 `sudo dnf install google-noto-sans-cjk-fonts`，conda 用 "
                   "`conda install -c conda-forge font-ttf-noto-cjk`，或者 `pip install mplfonts` 之后运行 "
                   "`mplfonts init`；macOS 和 Windows 已经自带（PingFang SC、Microsoft YaHei）")
_CJK = re.compile(r"[\u3000-\u303f\u3400-\u9fff\uff00-\uffef]")
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def language() -> str:
    """"zh" or "en": `FSDP_COURSE_LANG` if set, else "zh" inside `lessons/zh/` or `exercises/zh/`, else "en"."""
    value = os.environ.get("FSDP_COURSE_LANG", "").strip().lower().replace("-", "_")
    if value:
        for lang in LANGUAGES:
            if value == lang or value.startswith(lang + "_"):
                return lang
        _warn_once(f"FSDP_COURSE_LANG={value!r} is not a language of the course ({', '.join(LANGUAGES)}): "
                   "using English")
        return "en"
    try:
        cwd = Path.cwd()
    except OSError:  # the working directory was removed
        return "en"
    return "zh" if cwd.name == "zh" and cwd.parent.name in ("lessons", "exercises") else "en"


@cache
def _patterns() -> list[tuple[re.Pattern[str], str]]:
    from fsdp_course.i18n import zh

    return [(re.compile(pattern), template) for pattern, template in zh.PATTERNS]


def translate(text: str) -> str | None:
    """The Chinese of an English figure text: an exact entry of `zh.TEXT`, else the first of `zh.PATTERNS` that
    matches all of it (its groups filled into the template), else line by line; None if nothing matches."""
    from fsdp_course.i18n import zh

    if text in zh.TEXT:
        return zh.TEXT[text]
    for pattern, template in _patterns():
        m = pattern.fullmatch(text)
        if m:
            return m.expand(template)
    if "\n" in text:
        lines = text.split("\n")
        done = [translate(line) if line.strip() else line for line in lines]
        if any(d is not None for d in done):
            return "\n".join(d if d is not None else line for d, line in zip(done, lines, strict=True))
    return None


@cache
def cjk_font() -> str | None:
    """The name of a CJK font matplotlib can use, or None. Looks again past matplotlib's font cache once, for a
    font installed after the cache was built."""
    from matplotlib import font_manager

    def find(manager: Any) -> str | None:
        names = {f.name for f in manager.ttflist}
        return next((name for name in CJK_FONTS if name in names), None)

    found = find(font_manager.fontManager)
    if found is None:  # a font installed since matplotlib's cache was built: scan the system fonts again
        fresh = font_manager._load_fontmanager(try_read_cache=False)
        found = find(fresh)
        for entry in fresh.ttflist:  # into the manager every matplotlib function holds, not a new one
            if entry.name == found:
                font_manager.fontManager.addfont(entry.fname)
    return found


def _has_letters(text: str) -> bool:
    """Text worth translating: two Latin letters in a row, outside a mathtext tick label such as `$2^{3}$`."""
    return not (text.startswith("$") and text.endswith("$")) and bool(re.search(r"[A-Za-z]{2}", text))


def _missing(text: str) -> None:
    path = os.environ.get("FSDP_COURSE_I18N_MISSING")  # authors: where to list figure texts with no Chinese
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(repr(text) + "\n")


def translate_text(artist: Any) -> None:
    """Put the Chinese of a matplotlib Text's English in its place (idempotent), with a CJK font to fall back on."""
    text = artist.get_text()
    if not text or _CJK.search(text) or not _has_letters(text):
        return
    zh = translate(text)
    if zh is None:
        _missing(text)
    elif zh != text:
        artist.set_text(zh)
        family = list(artist.get_fontfamily())
        font = cjk_font()
        if font is not None and font not in family:  # each glyph from the first family that has it
            artist.set_fontfamily([*family, font])


def translate_figure(fig: Any) -> None:
    """Translate every text `fig` holds now (tick labels are made again at each draw: `Text.draw` translates them)."""
    from matplotlib.text import Text

    for artist in fig.findobj(Text):
        translate_text(artist)


_installed = False


def use_chinese_figures() -> bool:
    """Make every matplotlib figure translate its texts when drawn, in a CJK font. False (English figures, one
    warning) when the machine has no CJK font."""
    global _installed
    if _installed:
        return True
    font = cjk_font()
    if font is None:
        _warn_once("fsdp_course: no Chinese font found, so figures keep their English labels. " + INSTALL_FONT
                   + "\nfsdp_course：没有找到中文字体，所以图中的文字保持英文。" + INSTALL_FONT_ZH)
        return False
    import matplotlib
    from matplotlib.text import Text

    # a list of families: matplotlib takes each glyph from the first that has it (Latin and Greek from the usual font)
    family = [f for f in matplotlib.rcParams["font.family"] if f != font]
    matplotlib.rcParams["font.family"] = [*family, font]
    original = Text.draw  # every title, label, legend entry, annotation and tick label is drawn through it

    @wraps(original)
    def draw(self: Text, renderer: Any) -> Any:
        translate_text(self)
        return original(self, renderer)

    Text.draw = draw
    _installed = True
    return True


def activate() -> None:
    """Called by `import fsdp_course`: in Chinese, figures speak Chinese."""
    if language() == "zh":
        try:
            use_chinese_figures()
        except ImportError:  # matplotlib is a dependency; a stripped environment keeps English
            pass
