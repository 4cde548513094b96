"""The Chinese of the course's figure texts (see `fsdp_course.i18n`; checker hints: `zh_hints.py`).

TEXT: exact English figure text -> Chinese. PATTERNS: (regular expression matching a whole figure text, template
with \\1, \\2 ... for its groups). Vocabulary: the article's (分片, 全聚合 AllGather, 归约分散 ReduceScatter, ...).
"""

from __future__ import annotations

TEXT: dict[str, str] = {
}

PATTERNS: list[tuple[str, str]] = [
]
