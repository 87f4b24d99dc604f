"""`voltserve <command>`: each command lives in the module that owns it and is imported lazily,
so `voltserve gateway` never imports torch and `voltserve check-kernels` never loads a model."""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("voltserve.services.launcher", "run all services on this machine"),
    "gateway": ("voltserve.services.gateway.main", "run the OpenAI-compatible HTTP gateway"),
    "renderer": ("voltserve.services.renderer.main", "run a tokenizer/chat-template renderer"),
    "scheduler": ("voltserve.services.scheduler.main", "run the scheduler (leader or standby)"),
    "executor": ("voltserve.services.executor.main", "run one executor (one per GPU)"),
    "warmup": (
        "voltserve.services.executor.warmup",
        "compile the kernels `serve` with the same flags needs into the kernel cache",
    ),
    "generate": ("voltserve.services.executor.generate", "generate from a prompt in-process"),
    "make-demo-model": (
        "voltserve.services.executor.demo_model",
        "write a small random-weight checkpoint with a trained tokenizer",
    ),
    "check-kernels": (
        "voltserve.kernels.runtime.check",
        "compile every kernel for a compute capability (no GPU needed)",
    ),
}


def command(*args: str) -> list[str]:
    """The argv that runs `voltserve ARGS` in a new process of this interpreter. -P keeps the
    working directory off the child's sys.path: in a checkout, the root's kernels/, shared/ and
    services/ folders would shadow packages of those names (Hugging Face's `kernels`, which
    transformers imports)."""
    return [sys.executable, "-P", "-m", "voltserve.cli", *args]


def usage() -> str:
    lines = ["usage: voltserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"voltserve: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(COMMANDS[name][0])
    # Each command module exposes main(argv: list[str]) -> None.
    module.main(rest)


if __name__ == "__main__":
    main()
