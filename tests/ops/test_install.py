"""voltserve installs and runs as a package, and its checkout's folders never shadow another
package.

The root folders kernels/, shared/ and services/ are installed as voltserve.kernels,
voltserve.shared and voltserve.services. Whenever the root itself is on sys.path they are also
importable by those bare names, and `kernels` is a real package (Hugging Face's, which
transformers imports when it builds a model). So: the package list in pyproject.toml covers every
folder, a wheel built from the tracked files serves from another directory, and in every
process voltserve starts (pytest, `voltserve serve` and its services, a benchmark script),
`import kernels` finds the installed package, never the checkout's folder."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import util
from pathlib import Path

import pytest

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CHECKOUT_KERNELS = ROOT / "kernels"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]

# Records, for each Python process started with it on PYTHONPATH, where `kernels` and
# `voltserve` resolve and what sys.path is, at the first import of voltserve (or of a benchmark
# script's package): by then the interpreter has put the script's folder or the working
# directory on sys.path, if it ever does.
PROBE = """
import json, os, sys
from importlib import util

_done = False


def _record(event, args):
    global _done
    if _done or event != "import":
        return
    name = args[0]
    if not (name.split(".")[0] == "voltserve" or name in ("_as_script", "load_tests")):
        return
    _done = True
    spec = util.find_spec("kernels")
    voltserve = util.find_spec("voltserve")
    with open(os.path.join(os.environ["VOLTSERVE_IMPORT_PROBE"], f"{os.getpid()}.json"), "w") as f:
        json.dump({
            "argv": sys.argv,
            "kernels": spec.origin if spec else None,
            "voltserve": voltserve.origin if voltserve else None,
            "sys_path": sys.path,
        }, f)


sys.addaudithook(_record)
"""


def probe_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    site = tmp_path / "probe-site"
    out = tmp_path / "probe-out"
    site.mkdir()
    out.mkdir()
    (site / "sitecustomize.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(
        PYTHONPATH=str(site),
        VOLTSERVE_IMPORT_PROBE=str(out),
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env, out


def probe_records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def assert_no_checkout_on_path(record: dict) -> None:
    where = " ".join(record["argv"])
    paths = [os.path.realpath(p or os.getcwd()) for p in record["sys_path"]]
    assert str(ROOT) not in paths, f"{where}: the checkout's root is on sys.path"
    assert record["kernels"] and not record["kernels"].startswith(str(CHECKOUT_KERNELS)), (
        f"{where}: `import kernels` finds {record['kernels']}"
    )


def hf_kernels_installed() -> bool:
    spec = util.find_spec("kernels")
    return spec is not None and not spec.origin.startswith(str(CHECKOUT_KERNELS))


def test_pyproject_lists_every_package_folder():
    """Packages are listed by hand (three root folders map into one namespace, which
    setuptools' find cannot express); every folder of Python files must be among them."""
    package_dir = SETUPTOOLS["package-dir"]
    listed = set(SETUPTOOLS["packages"])
    found = set()
    for package, folder in package_dir.items():
        for init in (ROOT / folder).rglob("*.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join([package, *rel.parts]))
    missing = sorted(found - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"
    assert not sorted(listed - found), sorted(listed - found)


def test_pytest_imports_the_installed_kernels_package():
    import voltserve.kernels

    assert Path(voltserve.kernels.__file__).resolve().parent == ROOT / "kernels"
    assert str(ROOT) not in [os.path.realpath(p or os.getcwd()) for p in sys.path]
    if not hf_kernels_installed():
        pytest.skip("Hugging Face's `kernels` is not installed here")
    import kernels

    assert not Path(kernels.__file__).resolve().is_relative_to(CHECKOUT_KERNELS), kernels.__file__


def test_a_benchmark_script_run_from_the_root_does_not_put_it_on_sys_path(tmp_path):
    env, out = probe_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, "load_tests/bench_serving.py", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    (record,) = probe_records(out)
    assert_no_checkout_on_path(record)


def wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"/health not ready in {timeout} s:\n{log.read_text()[-4000:]}")


def serve_and_chat(voltserve: list[str], model: Path, cwd: Path, env: dict, log: Path) -> str:
    """`voltserve serve` from `cwd`, one chat completion with the openai client; its text."""
    import openai

    port = free_port()
    argv = [*voltserve, "serve", "--model", str(model), "--served-model-name", "demo"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    argv += ["--num-kv-blocks", "64", "--max-model-len", "256"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, log)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=60)
        reply = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.usage.completion_tokens > 0, reply
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
        return reply.choices[0].message.content
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@dataclass
class WheelInstall:
    venv: Path
    site: str  # the venv's own site-packages, where the wheel installed voltserve

    @property
    def voltserve(self) -> list[str]:
        return [str(self.venv / "bin" / "voltserve")]


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory) -> WheelInstall:
    """A wheel built from the tracked files (as a clean clone has them), every tracked file of a
    package folder in it, installed without editable mapping into a fresh venv. The venv reads
    the test environment's dependencies as a site directory of its own, after its own
    site-packages, so voltserve comes from the wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for rel in tracked_files():
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    dist = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(dist), str(src)],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("voltserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every tracked file inside a package folder is in the wheel: code and the data it reads.
    package_dir = SETUPTOOLS["package-dir"]
    for package, folder in package_dir.items():
        for rel in tracked_files():
            if not rel.startswith(folder + "/"):
                continue
            inner = rel[len(folder) + 1 :]
            # A folder mapped elsewhere (voltserve.kernels from kernels/) is checked there.
            installed = "/".join([*package.split("."), inner])
            assert installed in names, f"{rel} is not in the wheel (as {installed})"

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = sysconfig.get_paths()["purelib"]
    Path(site, "voltserve-test-deps.pth").write_text(f"import site; site.addsitedir({deps!r})\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
        + ["--no-index", str(wheel)],
        check=True,
        timeout=300,
    )
    return WheelInstall(venv, site)


def assert_from_the_wheel(records: list[dict], wheel: WheelInstall) -> None:
    for record in records:
        assert_no_checkout_on_path(record)
        assert record["voltserve"].startswith(wheel.site + os.sep), record


@contextlib.contextmanager
def outside_the_checkout() -> Iterator[Path]:
    """A fresh working directory under /tmp (never inside the checkout)."""
    run_dir = Path("/tmp") / f"voltserve-wheel-{os.getpid()}-{time.monotonic_ns()}"
    run_dir.mkdir()
    try:
        yield run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def demo_model(wheel_install, tmp_path_factory) -> Path:
    """`voltserve make-demo-model`, run once by the wheel's command with /tmp as working
    directory, that process checked by the probe as the wheel's services are; both serving
    tests serve it."""
    tmp = tmp_path_factory.mktemp("demo")
    path = tmp / "model"
    env, out = probe_env(tmp)
    with outside_the_checkout() as run_dir:
        subprocess.run(
            [*wheel_install.voltserve, "make-demo-model", str(path)],
            cwd=run_dir,
            env=env,
            check=True,
            timeout=300,
        )
    records = probe_records(out)
    assert len(records) == 1, [r["argv"] for r in records]
    assert_from_the_wheel(records, wheel_install)
    return path


@pytest.mark.slow
def test_serve_from_the_checkout_root_keeps_it_off_every_service_path(demo_model, tmp_path):
    """The worst case: `voltserve serve` started with the checkout as working directory. The
    launcher and each service it starts resolve `kernels` outside the checkout."""
    env, out = probe_env(tmp_path)
    voltserve = [str(Path(sys.executable).with_name("voltserve"))]
    serve_and_chat(voltserve, demo_model, ROOT, env, tmp_path / "serve.log")
    records = probe_records(out)
    # The launcher and the four services it starts (valkey is no Python process).
    assert len(records) >= 5, [r["argv"] for r in records]
    for record in records:
        assert_no_checkout_on_path(record)


def tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    )
    return [f for f in out.stdout.decode().split("\0") if f]


@pytest.mark.slow
def test_wheel_installs_and_serves_from_another_directory(wheel_install, demo_model, tmp_path):
    """The installed wheel (`wheel_install`, whose `voltserve make-demo-model` made
    demo_model) serves a chat completion with /tmp as working directory: the launcher and each
    service it starts import voltserve from the wheel and `kernels` from outside the checkout."""
    with outside_the_checkout() as run_dir:
        env, out = probe_env(tmp_path)
        serve_and_chat(wheel_install.voltserve, demo_model, run_dir, env, tmp_path / "serve.log")
    records = probe_records(out)
    # The launcher and the four services it starts (valkey is no Python process).
    assert len(records) >= 5, [r["argv"] for r in records]
    assert_from_the_wheel(records, wheel_install)
