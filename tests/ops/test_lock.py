"""What `make` installs is locked: requirements/cpu.lock and cuda.lock pin every package exactly,
each satisfies pyproject.toml's ranges, the Makefile installs from them, and the environment the
tests run in (when `make` built it) holds exactly the locked versions."""

from __future__ import annotations

import re
import shlex
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCKS = sorted((ROOT / "requirements").glob("*.lock"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def read_lock(path: Path) -> dict[str, tuple[Version, Requirement]]:
    """name -> (pinned version, the requirement line with its marker)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{path.name}: {line!r} is not an exact pin"
        pins[canonicalize_name(req.name)] = (Version(spec.version), req)
    return pins


def project_requirements() -> list[Requirement]:
    project = PYPROJECT["project"]
    specs = project["dependencies"] + project["optional-dependencies"]["dev"]
    return [Requirement(s) for s in specs]


def makefile_var(name: str) -> list[str]:
    """Every value the Makefile gives `name` (one per branch of a conditional)."""
    values = re.findall(rf"^{name} :?= (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert values, f"Makefile defines no {name}"
    return values


def test_both_locks_exist():
    assert [p.name for p in LOCKS] == ["cpu.lock", "cuda.lock"]


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_lock_pins_every_project_requirement_within_its_range(lock):
    pins = read_lock(lock)
    env = {**default_environment(), "python_version": "3.11", "python_full_version": "3.11.7"}
    for req in project_requirements():
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{lock.name} has no pin for {req}: run `make lock`"
        version, _ = pins[name]
        assert req.specifier.contains(version, prereleases=True), (
            f"{lock.name} pins {name}=={version}, outside pyproject.toml's {req}: run `make lock`"
        )


def test_cpu_lock_takes_torch_without_its_cuda_libraries():
    """numba-cuda[cu12] brings NVVM and the CUDA runtime (the cc 7.0 compile check needs them);
    torch's CUDA build would bring cuBLAS, cuDNN and NCCL, gigabytes a CPU machine never uses."""
    pins = read_lock(ROOT / "requirements/cpu.lock")
    assert "torch" in pins
    for name in ("nvidia-cublas-cu12", "nvidia-cudnn-cu12", "nvidia-nccl-cu12"):
        assert name not in pins, f"cpu.lock holds {name}: torch's CUDA build"
    cuda = read_lock(ROOT / "requirements/cuda.lock")
    assert "nvidia-cublas-cu12" in cuda, "cuda.lock lacks torch's CUDA libraries"


def test_kernel_deps_are_project_requirements_installed_under_the_lock():
    """The first install step (what the cc 7.0 compile check imports) takes its versions from
    the lock too: its packages are named without versions, under `-c $(LOCK)`."""
    names = {canonicalize_name(r.name) for r in project_requirements()}
    (deps_line,) = makefile_var("KERNEL_DEPS")
    deps = shlex.split(deps_line)
    assert deps
    for spec in deps:
        req = Requirement(spec)
        assert not req.specifier, f"KERNEL_DEPS pins {spec}: versions come from the lock"
        assert canonicalize_name(req.name) in names, spec
    assert "-c $(LOCK) $(KERNEL_DEPS)" in makefile_var("KERNEL_SPECS")
    assert "-r $(LOCK)" in makefile_var("PROJECT_SPECS")


def _installed_from() -> str | None:
    marker = Path(sys.prefix) / ".installed"
    return marker.read_text().strip() if marker.is_file() else None


def test_the_running_environment_holds_exactly_the_locked_versions():
    source = _installed_from()
    if source is None or not source.endswith(".lock"):
        pytest.skip(f"this environment was not installed from a lock by make ({source!r})")
    pins = read_lock(ROOT / source)
    env = default_environment()
    wrong = []
    for name, (version, req) in pins.items():
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            wrong.append(f"{name}=={version}: not installed")
            continue
        # A local label (torch's +cpu) is the build, not the release the lock pins.
        if Version(installed.public) != version:
            wrong.append(f"{name}=={version}: {installed} installed")
    assert not wrong, f"{source}: " + "; ".join(wrong)
    print(f"{source}: transformers {metadata.version('transformers')}")
