"""The docs speak of the software, not of how its work was organised."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PROCESS_WORDS = re.compile(
    r"\bthis stop\b|\bprevious stop\b|\bstop's\b|other developers|the issue's list",
    re.IGNORECASE)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_words_about_how_the_work_was_done(doc):
    hits = [f"{doc.name}:{n}: {line.strip()}" for n, line in enumerate(doc.read_text().splitlines(), 1)
            if PROCESS_WORDS.search(line)]
    assert not hits, "\n".join(hits)
