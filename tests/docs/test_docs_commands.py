"""The commands in the documents run as written.

Every shell block (```bash, ```sh, ```shell, ```console) of README.md, BENCHMARKS.md,
CONTRIBUTING.md, PERF_NOTES.md and docs/architecture.md is split into commands. None is run:
servers, benchmarks and GPU work take minutes. Each is checked against what it names instead:

- `voltserve CMD ...` (also `python -m voltserve.cli CMD`): the command exists, and its
  arguments parse with that command's own argparse parser, every `--flag` spelled out in full;
- `python load_tests/X.py ...`: the script exists and its arguments parse with its parser
  (bench_serving's arguments after `--` with `voltserve serve`'s);
- `make X VAR=...`: the target and the variables exist in the Makefile (SERVE_ARGS parse as
  `voltserve serve` flags);
- `scripts/gpu_check.sh OUT STAGE...`: every stage is one the script knows, every variable set
  before it is one it reads;
- pytest and any other path into the repository: the file or folder exists;
- a VOLTSERVE_* variable set before a command is read somewhere in the code.

The parser is the one each command's main() builds: main([]) runs until it calls parse_args,
which is intercepted there, so nothing else of the command runs.

A block whose commands need a CUDA GPU starts with the line `# needs a CUDA GPU`. Its commands
are checked the same way (parsing needs no GPU), and a command that needs a GPU must be in such a
block. Inline spans that start with `voltserve `, `make ` or `scripts/gpu_check.sh ` are
fragments; their command names, flags and stages are checked, their arguments not parsed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import inspect
import io
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

from tests.docs.markdown import (
    COMMAND_DOCS,
    GPU_MARK,
    ROOT,
    SHELL_LANGS,
    Command,
    blocks,
    commands,
    indented_code_lines,
    inline_spans,
    markdown_files,
    section,
)

DOCS = [ROOT / d for d in COMMAND_DOCS if (ROOT / d).is_file()]

# Programs whose arguments these tests do not check (system tools, services of their own).
UNCHECKED = {
    "apt-get", "cat", "cd", "cp", "curl", "docker", "echo", "export", "git", "grep", "head",
    "jq", "kill", "ls", "mkdir", "nvidia-smi", "pip", "py-spy", "redis-cli", "rm", "ruff",
    "sleep", "tail", "tar", "tee", "valkey-cli", "wget",
}  # fmt: skip
REPO_DIRS = ("load_tests", "scripts", "tests", "kernels", "services", "shared", "compose", "docs",
             "voltserve")  # fmt: skip
# Options whose value is a path the command writes (it need not exist yet).
OUTPUT_OPTS = {"--out", "--out-dir", "--workdir", "--model-dir", "--output", "-o"}
# load_tests scripts that refuse to run without CUDA.
GPU_SCRIPTS = {
    "load_tests/bench_attention.py",
    "load_tests/bench_gemm.py",
    "load_tests/bench_kernels_elementwise.py",
    "load_tests/bench_prefill_attention.py",
    "load_tests/profile_decode_step.py",
    "load_tests/profile_kernels.py",
}
PYTEST_VALUE_OPTS = {"-k", "-m", "-p", "-n", "-o", "-c", "--timeout", "--maxfail", "--tb",
                     "--durations", "--rootdir", "--junitxml", "--basetemp"}  # fmt: skip


# ---- parsers --------------------------------------------------------------------------------


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def captured_parser(main) -> argparse.ArgumentParser:
    """The parser main() builds, taken at its parse_args call (nothing after it runs)."""

    def grab(self, *args, **kwargs):
        raise _Caught(self)

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", grab),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", grab),
    ):
        try:
            main([]) if inspect.signature(main).parameters else main()
        except _Caught as c:
            return c.parser
    raise AssertionError(f"{main.__module__}.main() returned without parsing arguments")


@functools.cache
def voltserve_commands() -> dict[str, str]:
    from voltserve.cli import COMMANDS

    return {name: module for name, (module, _) in COMMANDS.items()}


@functools.cache
def voltserve_parser(name: str) -> argparse.ArgumentParser:
    return captured_parser(importlib.import_module(voltserve_commands()[name]).main)


@functools.cache
def script_parser(rel: str) -> argparse.ArgumentParser:
    module = importlib.import_module(rel[: -len(".py")].replace("/", "."))
    return captured_parser(module.main)


def _options(parser: argparse.ArgumentParser, args: list[str]) -> set[str]:
    """Option strings of the parser, and of the sub-command args name (if it has any)."""
    opts = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for a in args:
                if a in action.choices:
                    opts |= set(action.choices[a]._option_string_actions)
                    break
    return opts


def check_args(parser: argparse.ArgumentParser, args: list[str], cmd: Command, what: str) -> None:
    opts = _options(parser, args)
    for a in args:
        if a == "--":
            break
        if a.startswith("-") and not re.fullmatch(r"-\d[\d.]*", a):
            name = a.split("=", 1)[0]
            assert name in opts, f"{cmd.where()}\n  {what} has no option {name}"
    if cmd.partial:
        return
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(args)
        except SystemExit as e:
            assert e.code in (0, None), f"{cmd.where()}\n  {what} rejects it:\n{err.getvalue()}"


# ---- the repository's other command surfaces -------------------------------------------------


@functools.cache
def makefile() -> tuple[set[str], set[str]]:
    """(targets, variables) of the Makefile."""
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))
    variables = set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*[?:+]?=", text, re.M))
    variables |= set(re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", text))
    return targets, variables


GPU_CHECK = "scripts/gpu_check.sh"


@functools.cache
def gpu_check() -> tuple[set[str], str]:
    """(stage names, script text) of scripts/gpu_check.sh."""
    text = (ROOT / GPU_CHECK).read_text()
    body = text[text.index("case $stage in") :]
    # A case pattern may list alternatives: `quant|quant-tests|quant-bench)`.
    patterns = re.findall(r"^\s+([a-z0-9|-]+)\)\s*$", body, re.M)
    stages = {name for p in patterns for name in p.split("|")}
    return stages, text


@functools.cache
def source_text() -> str:
    """The code that may read a switch (the tests read a few of their own; not this folder)."""
    parts = []
    for d in ("kernels", "services", "shared", "voltserve", "load_tests", "scripts", "tests"):
        for p in (ROOT / d).rglob("*"):
            if p.suffix in (".py", ".sh") and Path(__file__).parent not in p.parents:
                parts.append(p.read_text())
    return "\n".join(parts)


def _norm(path: str) -> str:
    return path[2:] if path.startswith("./") else path


def check_path(path: str, cmd: Command) -> None:
    p = _norm(path).split("::", 1)[0]
    if any(c in p for c in "*?{}$"):
        return
    assert (ROOT / p).exists(), f"{cmd.where()}\n  {p} does not exist"


def check_repo_paths(cmd: Command) -> None:
    prev = ""
    for a in cmd.argv[1:]:
        if prev not in OUTPUT_OPTS and _norm(a).split("/", 1)[0] in REPO_DIRS and "/" in a:
            check_path(a, cmd)
        prev = a


def check_env(cmd: Command) -> None:
    for name in cmd.env:
        if name.startswith("VOLTSERVE_"):
            assert name in source_text(), f"{cmd.where()}\n  no code reads {name}"


# ---- one checker per program ----------------------------------------------------------------


def check_voltserve(args: list[str], cmd: Command) -> None:
    assert args, f"{cmd.where()}\n  voltserve needs a command"
    if args[0] in ("-h", "--help"):
        return
    names = args[0].split("|") if cmd.partial else [args[0]]
    for name in names:
        assert name in voltserve_commands(), f"{cmd.where()}\n  voltserve has no command {name!r}"
        check_args(voltserve_parser(name), args[1:], cmd, f"voltserve {name}")


def check_serve_flags(flags: list[str], cmd: Command) -> None:
    """Flags handed on to `voltserve serve` (make's SERVE_ARGS, bench_serving's `-- ...`)."""
    check_args(voltserve_parser("serve"), ["--model", "MODEL", *flags], cmd, "voltserve serve")


def check_make(args: list[str], cmd: Command) -> None:
    targets, variables = makefile()
    for a in args:
        if a.startswith("-"):
            continue
        if "=" in a:
            name, _, value = a.partition("=")
            assert name in variables, f"{cmd.where()}\n  the Makefile has no variable {name}"
            if name == "SERVE_ARGS":
                check_serve_flags(shlex.split(value), cmd)
        else:
            assert a in targets, f"{cmd.where()}\n  the Makefile has no target {a!r}"


def check_gpu_check(args: list[str], cmd: Command) -> None:
    stages, text = gpu_check()
    for name in cmd.env:
        assert re.search(rf"\$\{{?{name}\b", text) or name.startswith("VOLTSERVE_"), (
            f"{cmd.where()}\n  {GPU_CHECK} does not read {name}"
        )
    for stage in args[1:]:  # args[0] is the output folder
        assert stage in stages, f"{cmd.where()}\n  {GPU_CHECK} has no stage {stage!r}"


def check_pytest(args: list[str], cmd: Command) -> None:
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a in PYTEST_VALUE_OPTS:
            skip = True
        elif not a.startswith("-"):
            check_path(a, cmd)


def check_script(path: str, args: list[str], cmd: Command) -> None:
    check_path(path, cmd)
    rel = _norm(path)
    if not (rel.startswith("load_tests/") and rel.endswith(".py")):
        return
    trailing: list[str] = []
    if rel == "load_tests/bench_serving.py" and "--" in args:
        k = args.index("--")
        args, trailing = args[:k], args[k + 1 :]
        check_serve_flags(trailing, cmd)
    check_args(script_parser(rel), args, cmd, rel)


def check_python(args: list[str], cmd: Command) -> None:
    while args and args[0] in ("-u", "-B", "-O", "-X"):
        args = args[2:] if args[0] == "-X" else args[1:]
    assert args, f"{cmd.where()}\n  python with nothing to run"
    if args[0] == "-c":
        return
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "pytest":
            check_pytest(rest, cmd)
        elif module == "voltserve.cli":
            check_voltserve(rest, cmd)
        else:
            assert importlib.util.find_spec(module), f"{cmd.where()}\n  no module {module}"
        return
    check_script(args[0], args[1:], cmd)


def program(argv0: str) -> str:
    """`.venv/bin/voltserve` -> `voltserve`; `python3.11` -> `python`; paths stay paths."""
    if argv0.startswith((".venv/bin/", "./.venv/bin/")):
        argv0 = argv0.rsplit("/", 1)[1]
    return "python" if re.fullmatch(r"python(3(\.\d+)?)?", argv0) else argv0


def check_command(cmd: Command) -> None:
    check_env(cmd)
    check_repo_paths(cmd)
    prog, args = program(cmd.argv[0]), cmd.argv[1:]
    if prog == "voltserve":
        check_voltserve(args, cmd)
    elif prog == "make":
        check_make(args, cmd)
    elif prog == "python":
        check_python(args, cmd)
    elif prog == "pytest":
        check_pytest(args, cmd)
    elif prog in ("bash", "sh"):
        check_script(args[0], args[1:], cmd)
        if _norm(args[0]) == GPU_CHECK:
            check_gpu_check(args[1:], cmd)
    elif "/" in prog:
        check_script(prog, args, cmd)
        if _norm(prog) == GPU_CHECK:
            check_gpu_check(args, cmd)
    else:
        assert prog in UNCHECKED, (
            f"{cmd.where()}\n  unknown program {prog!r}: teach this test to check it, or add it "
            "to UNCHECKED if there is nothing of the repository's to check"
        )


def needs_gpu(cmd: Command) -> str | None:
    """Why the command needs a CUDA GPU, or None."""
    argv = [_norm(a) for a in cmd.argv]
    text = " ".join(argv)
    if GPU_CHECK in argv or ("make" in argv[:1] and "gpu-check" in argv):
        return "it runs the GPU checks"
    if re.search(r"(^|\s)tests/gpu\b", text):
        return "it runs the GPU tests"
    if any(a in GPU_SCRIPTS for a in argv):
        return "the benchmark refuses to run without CUDA"
    if re.search(r"--device[ =]cuda\b", text):
        return "it asks for --device cuda"
    m = re.search(r"--preset[ =](\S+)", text)
    if m and m.group(1) != "tiny":
        return f"the {m.group(1)} preset is a GPU-sized checkpoint"
    return None


# ---- collecting -------------------------------------------------------------------------------


def doc_commands() -> list[Command]:
    out: list[Command] = []
    for doc in DOCS:
        for b in blocks(doc):
            if b.lang in SHELL_LANGS:
                out += commands(b)
    return out


def inline_commands() -> list[Command]:
    out = []
    for doc in DOCS:
        rel = str(doc.relative_to(ROOT))
        for line, span in inline_spans(doc):
            if span.startswith(("voltserve ", "make ", GPU_CHECK + " ")):
                try:
                    argv = shlex.split(span)
                except ValueError:
                    continue
                out.append(Command(rel, line, argv, partial=True))
    return out


BLOCK_COMMANDS = doc_commands()
INLINE = inline_commands()


def test_the_documents_have_commands() -> None:
    # The extraction found something in each document that has shell blocks.
    assert {c.doc for c in BLOCK_COMMANDS} >= {"README.md", "BENCHMARKS.md", "CONTRIBUTING.md"}
    assert any(c.gpu for c in BLOCK_COMMANDS) and any(not c.gpu for c in BLOCK_COMMANDS)


@pytest.mark.parametrize("cmd", BLOCK_COMMANDS, ids=lambda c: f"{c.doc}:{c.line}")
def test_block_command(cmd: Command) -> None:
    check_command(cmd)
    why = needs_gpu(cmd)
    assert cmd.gpu or why is None, (
        f"{cmd.where()}\n  needs a CUDA GPU ({why}): put it in a block that starts with "
        f"'{GPU_MARK}'"
    )


@pytest.mark.parametrize("cmd", INLINE, ids=lambda c: f"{c.doc}:{c.line}")
def test_inline_command(cmd: Command) -> None:
    check_command(cmd)


def test_commands_sit_in_fenced_blocks() -> None:
    # An indented code block's commands would escape the checks above.
    found = {str(d.relative_to(ROOT)): indented_code_lines(d) for d in DOCS}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"indented code blocks (use a ```bash fence instead): {found}"


def test_readme_flags_table_names_serve_flags() -> None:
    text = section(ROOT / "README.md", "Flags")
    opts = set(voltserve_parser("serve")._option_string_actions)
    flags = {s.split()[0] for s in re.findall(r"`(--[^`]+)`", text)}
    assert flags, "the Flags section lists no flags"
    assert not flags - opts, f"`voltserve serve` has no {sorted(flags - opts)}"


def test_documented_switches_exist() -> None:
    # The engine switches a user is told to set are read by the code.
    for doc in ("README.md", "CONTRIBUTING.md"):
        names = set(re.findall(r"\bVOLTSERVE_[A-Z0-9_]+\b", (ROOT / doc).read_text()))
        unread = sorted(n for n in names if n not in source_text())
        assert not unread, f"{doc} names switches no code reads: {unread}"


def _expand(path: str) -> list[str]:
    """`a_{x,y}.json` -> [a_x.json, a_y.json] (one brace group)."""
    m = re.search(r"\{([^{}]+)\}", path)
    if not m:
        return [path]
    return [path[: m.start()] + alt + path[m.end() :] for alt in m.group(1).split(",")]


def test_result_files_named_in_the_documents_exist() -> None:
    missing = []
    for doc in DOCS + sorted((ROOT / "load_tests/results").rglob("README.md")):
        for line, span in inline_spans(doc):
            for token in span.split():
                if token.startswith("load_tests/results/"):
                    missing += [
                        f"{doc.relative_to(ROOT)}:{line}: {p}"
                        for p in _expand(token.rstrip(".,;:"))
                        if not any(c in p for c in "*<") and not (ROOT / p).exists()
                    ]
    assert not missing, "result files that do not exist:\n" + "\n".join(missing)


def test_relative_links_resolve() -> None:
    broken = []
    for doc in markdown_files():
        for m in re.finditer(r"\]\(([^)\s]+)\)", doc.read_text()):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"[a-z]+:", target):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {m.group(1)}")
    assert not broken, f"links to nothing: {broken}"


def test_current_figures_name_device_date_commit_and_record() -> None:
    text = section(ROOT / "BENCHMARKS.md", "Current figures")
    rows = [r for r in text.splitlines() if r.startswith("|")]
    header = [c.strip().lower() for c in rows[0].strip("|").split("|")]
    col = {name: header.index(name) for name in ("device", "date", "commit", "record")}
    assert len(rows) > 3
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(header), f"BENCHMARKS.md row has {len(cells)} cells: {row}"
        assert cells[col["device"]], f"no device: {row}"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells[col["date"]]), f"no date: {row}"
        assert re.fullmatch(r"`?[0-9a-f]{7,40}`?", cells[col["commit"]]), f"no commit: {row}"
        paths = re.findall(r"`(load_tests/results/[^`]+)`", cells[col["record"]])
        assert paths and all((ROOT / p).exists() for p in paths), f"no record file: {row}"
