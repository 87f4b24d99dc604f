"""The repository's documents speak of the project (its versions, commits, dates, figures), never
of how the work on it was organised: no working sessions, no budgets of machine time, no
helpers or leads. A small word list; the Markdown files are read whole."""

from __future__ import annotations

import re

import pytest

from tests.docs.markdown import ROOT, markdown_files

# What a sentence about the project has no need of.
PROCESS_WORDS = [
    r"\bsessions?\b",
    r"\bdevice[- ]time\b",
    r"\bdevice calls?\b",
    r"\bhelpers?\b",
    r"\bthe lead\b",
]
PATTERN = re.compile("|".join(PROCESS_WORDS), re.I)


def test_the_word_list_finds_what_it_should() -> None:
    for text in ("in the fifth session", "no device time left", "a test helper", "Device-time"):
        assert PATTERN.search(text), text
    for text in ("the leader's lease", "a lead-in", "devices timed"):
        assert not PATTERN.search(text), text


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_process_wording(path) -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{i}: {m.group(0)!r} in {line.strip()[:120]!r}"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        for m in PATTERN.finditer(line)
    ]
    assert not hits, "\n".join(hits)
