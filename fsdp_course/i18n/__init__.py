"""The language the course speaks (English or Chinese), and a CJK font for its figures.

Design notes: docs/CLASSROOM.md, "Two languages", `__init__.py`.
"""

from __future__ import annotations

import os
import warnings
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["cjk_font", "figure_language", "language", "use_chinese_figures"]

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


def use_chinese_figures() -> bool:
    """Give matplotlib a CJK font to fall back on, so that figure text in Chinese shows (checked at every call: the
    font list may have been reset since). False (one warning) when the machine has no CJK font: figures then keep
    their English labels (`figure_language`)."""
    font = cjk_font()
    if font is None:
        _warn_once("fsdp_course: no Chinese font found, so figures keep their English labels. " + INSTALL_FONT
                   + "\nfsdp_course：没有找到中文字体，所以图中的文字保持英文。" + INSTALL_FONT_ZH)
        return False
    import matplotlib

    # a list of families: matplotlib takes each glyph from the first that has it (Latin and Greek from the usual font)
    family = list(matplotlib.rcParams["font.family"])
    if font not in family:
        matplotlib.rcParams["font.family"] = [*family, font]
    return True


def figure_language() -> str:
    """The language figures write in: the course's, except Chinese on a machine with no CJK font to show it, where
    figures keep their English labels (and one warning says which font to install)."""
    if language() != "zh":
        return "en"
    try:
        return "zh" if use_chinese_figures() else "en"
    except ImportError:  # no matplotlib: nothing is drawn anyway
        return "zh"


def activate() -> None:
    """Called by `import fsdp_course`: in Chinese, figures speak Chinese."""
    if language() == "zh":
        try:
            use_chinese_figures()
        except ImportError:  # matplotlib is a dependency; a stripped environment keeps English
            pass
