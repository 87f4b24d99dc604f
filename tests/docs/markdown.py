"""Reading the repository's Markdown: which files, their shell blocks split into commands, and
their inline code spans. Shared by the documentation tests."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The documents whose commands a reader is told to run.
COMMAND_DOCS = (
    "README.md",
    "BENCHMARKS.md",
    "CONTRIBUTING.md",
    "PERF_NOTES.md",
    "docs/architecture.md",
)

# The first line of a shell block whose commands need a CUDA GPU (it marks the rest of the block).
GPU_MARK = "# needs a CUDA GPU"

SHELL_LANGS = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_SEPARATORS = {";", "&&", "||", "|", "&"}
_SKIP_DIRS = {"node_modules", "__pycache__", "build", "dist"}


def markdown_files() -> list[Path]:
    """Every Markdown file of the repository (hidden folders, virtual environments and build
    output left out)."""
    out = []
    for p in sorted(ROOT.rglob("*.md")):
        parts = p.relative_to(ROOT).parts[:-1]
        if any(s.startswith(".") or s in _SKIP_DIRS or s.endswith(".egg-info") for s in parts):
            continue
        out.append(p)
    return out


@dataclass
class Command:
    doc: str  # path relative to the repository root
    line: int  # 1-based line of the command's first line
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    gpu: bool = False  # in a block marked GPU_MARK
    partial: bool = False  # an inline span: a fragment, not a whole command line

    def where(self) -> str:
        return f"{self.doc}:{self.line}: {' '.join(self.argv)}"


@dataclass
class Block:
    doc: str
    line: int  # line of the opening fence
    lang: str
    lines: list[str]


def blocks(path: Path) -> list[Block]:
    """Fenced code blocks (``` or ~~~), with their info string's first word."""
    out: list[Block] = []
    fence: str | None = None
    cur: Block | None = None
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
                cur = Block(str(path.relative_to(ROOT)), i, m.group(2).lower(), [])
        elif (
            m
            and m.group(1).startswith(fence[0])
            and len(m.group(1)) >= len(fence)
            and not m.group(2)
        ):
            out.append(cur)
            fence, cur = None, None
        else:
            cur.lines.append(line)
    return out


def indented_code_lines(path: Path) -> list[int]:
    """Lines that open an indented (4-space) code block outside fences and lists: such a
    block's commands would escape the checks, so the documents use fenced blocks."""
    found = []
    in_fence = False
    prev_blank, in_list = True, False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            prev_blank = False
            continue
        if in_fence:
            continue
        if not line.strip():
            prev_blank = True
            continue
        if re.match(r"\s*([-*+]|\d+\.)\s", line):
            in_list = True
        elif not line.startswith(" "):
            in_list = False
        if prev_blank and line.startswith("    ") and not in_list:
            found.append(i)
        prev_blank = False
    return found


def _split_line(text: str) -> list[list[str]]:
    """One shell line -> its simple commands' words (separators and redirections dropped)."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|<>")
    lex.whitespace_split = True
    lex.commenters = "#"
    words: list[list[str]] = [[]]
    skip_next = False
    for tok in lex:
        if skip_next:
            skip_next = False
        elif tok in _SEPARATORS:
            words.append([])
        elif set(tok) <= set("<>&") and set(tok) & set("<>"):  # a redirection: drop its target
            skip_next = True
        else:
            words[-1].append(tok)
    return [w for w in words if w]


def commands(block: Block) -> list[Command]:
    """The commands of a shell block. Lines ending in a backslash continue; a quoted string may
    span lines; `$ ` prompts are dropped; GPU_MARK marks every later command of the block."""
    out: list[Command] = []
    gpu = False
    pending, start = "", 0
    for offset, raw in enumerate(block.lines, 1):
        line = raw.strip()
        if not pending:
            if line.startswith(GPU_MARK):
                gpu = True
                continue
            if not line or line.startswith("#"):
                continue
            if line.startswith("$ "):
                line = line[2:]
            start = block.line + offset
        text = pending + line
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        try:
            parts = _split_line(text)
        except ValueError:  # an open quote: the string goes on over the next line
            pending = text + "\n"
            continue
        pending = ""
        for words in parts:
            env = {}
            while words and (words[0] == "env" or re.match(r"^[A-Za-z_]\w*=", words[0])):
                w = words.pop(0)
                if w != "env":
                    k, _, v = w.partition("=")
                    env[k] = v
            if words:
                out.append(Command(block.doc, start, words, env, gpu))
    assert not pending, f"{block.doc}:{block.line}: unterminated command in the block"
    return out


def inline_spans(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every inline code span outside fenced blocks; a span may run over a line
    break inside its paragraph (its text then has a space there)."""
    lines = path.read_text().splitlines()
    in_fence = False
    for i, line in enumerate(lines):
        fence = bool(_FENCE.match(line))
        if fence or in_fence:
            lines[i] = ""  # keeps the line numbers
        if fence:
            in_fence = not in_fence
    text = "\n".join(lines)
    return [
        (text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
        for m in re.finditer(r"(?<!`)`((?:[^`\n]|\n(?!\s*\n))+)`(?!`)", text)
    ]


def section(path: Path, title: str) -> str:
    """The text under the `## title` header, up to the next header of that level or above."""
    text = path.read_text()
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^#{{1,2}} |\Z)", text, re.M | re.S)
    assert m, f"{path.name} has no '## {title}' section"
    return m.group(1)
