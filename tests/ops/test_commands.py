"""Every command the compose services run exists, starts, and accepts the flags compose passes;
so does the Dockerfile's entry point."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
VOLTSERVE = shutil.which("voltserve", path=str(Path(sys.executable).parent)) or "voltserve"


def compose_commands() -> dict[str, list[str]]:
    stack = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    return {
        name: [str(a) for a in svc["command"]]
        for name, svc in stack["services"].items()
        if "compose/Dockerfile" in str(svc.get("build", {}).get("dockerfile", ""))
    }


def run_help(args: list[str]) -> str:
    p = subprocess.run(
        [VOLTSERVE, *args, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert p.returncode == 0, f"voltserve {' '.join(args)} --help failed:\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.mark.parametrize("service", sorted(compose_commands()))
def test_compose_command_exists_and_takes_its_flags(service: str) -> None:
    cmd = compose_commands()[service]
    help_text = run_help(cmd[:1])
    flags = {a.split("=", 1)[0] for a in cmd[1:] if a.startswith("--")}
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}\b", help_text))
    assert not missing, f"voltserve {cmd[0]} has no {missing}:\n{help_text}"


def dockerfile_instruction(name: str) -> list[str]:
    lines = (COMPOSE / "Dockerfile").read_text().splitlines()
    (line,) = [ln for ln in lines if ln.startswith(name + " ")]
    return json.loads(line[len(name) + 1 :])


def test_dockerfile_entrypoint_runs() -> None:
    entry, cmd = dockerfile_instruction("ENTRYPOINT"), dockerfile_instruction("CMD")
    # tini -- voltserve: tini only reaps and forwards signals; the program is voltserve.
    assert entry[0] == "tini" and entry[1] == "--", entry
    assert entry[2] == "voltserve"
    p = subprocess.run([VOLTSERVE, *entry[3:], *cmd], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for name in ("gateway", "renderer", "scheduler", "executor"):
        assert name in p.stdout


def test_unknown_command_fails() -> None:
    p = subprocess.run([VOLTSERVE, "no-such-command"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "unknown command" in p.stderr


def test_dockerfile_installs_every_package_folder() -> None:
    text = (COMPOSE / "Dockerfile").read_text()
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for folder in set(pyproject["tool"]["setuptools"]["package-dir"].values()):
        assert re.search(rf"^COPY {folder} ", text, re.M), f"Dockerfile does not copy {folder}/"
    base = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.", text, re.M)
    assert base and base.group(1) == "12", "CUDA 13 dropped SM70: the base must stay on 12.x"
