"""The Chinese of the checkers' most common problem and hint lines (see `fsdp_course.i18n.hint_zh`).

HINTS: (regular expression searched in a checker's English problem or hint line, Chinese template with \\1, \\2 ...
for its groups). The first that matches wins. Vocabulary: the article's (分片, 全聚合, 归约分散).
"""

from __future__ import annotations

HINTS: list[tuple[str, str]] = [
]
