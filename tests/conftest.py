"""Root test configuration, shared by every test folder.

Without a CUDA GPU, numba kernels run in numba's CUDA simulator. numba reads
NUMBA_ENABLE_CUDASIM once, when numba.cuda is first imported, so it is set here, before any test
module imports a kernel. torch is imported first to ask about the GPU (importing torch does not
import numba).

Randomness. Every test starts from a fresh seed: the global `random`, torch and numpy generators
are seeded with it before the test runs, and the `rng` fixture is a `random.Random` of the same
seed. A failing test's report shows `VOLTSERVE_TEST_SEED=<seed>`; running it again with that
environment variable replays the same draws. Tests must assert only what holds for every draw:
a property that needs a particular schedule is forced by how the inputs are built.

Parallel runs (pytest-xdist, `make test`): services that tests start listen on ports from
tests/ports.py, never on fixed ones, and keep their files under each test's tmp_path.
"""

from __future__ import annotations

import os
import random
import sys
import types
from pathlib import Path

import pytest

# One OpenMP thread per process. Tests run in two pytest-xdist workers on the CI machine's two
# cores (beside the cc 7.0 compile, and the services some tests start): with torch's default of
# one thread per core, every parallel op spin-waits for a thread the other worker holds. Measured
# on the 2-core machine: the quantized- and MoE-model engine tests took 78.8 s with two threads
# a process and 14.6 s with one. Set before torch is imported (libgomp reads it at load), and
# inherited by every process a test starts. An explicit OMP_NUM_THREADS wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

# The kernel cache (kernels/runtime/compile_cache.py) never touches the user's: every test session
# gets a fresh folder (subprocesses inherit it), removed at exit. VOLTSERVE_TEST_CACHE_DIR names a
# folder to keep instead (e.g. to rerun GPU tests without recompiling).
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if os.environ.get("VOLTSERVE_TEST_CACHE_DIR"):
    os.environ["VOLTSERVE_CACHE_DIR"] = os.environ["VOLTSERVE_TEST_CACHE_DIR"]
else:
    _cache_dir = tempfile.mkdtemp(prefix="voltserve-test-cache-")
    os.environ["VOLTSERVE_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# Tests share helpers as `tests.<module>` (tests/checkpoints.py, tests/engine/kv_echo_runner.py)
# and import benchmark scripts as `load_tests.<script>`, yet the repository root is never put on
# sys.path: its kernels/, shared/ and services/ folders would shadow packages of those names
# (Hugging Face's `kernels`, which transformers imports). The two folders become packages by
# name instead; voltserve itself comes from its install. pytest runs in importlib mode
# (pyproject.toml), so it inserts no folder of its own either.
_ROOT = Path(__file__).resolve().parents[1]


def _folder_package(name: str, folder: Path) -> None:
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        sys.modules[name] = module
    module.__path__ = [str(folder)]


_folder_package("tests", _ROOT / "tests")
_folder_package("load_tests", _ROOT / "load_tests")

SEED_ENV = "VOLTSERVE_TEST_SEED"


def draw_seed() -> int:
    """The seed for the test about to run: VOLTSERVE_TEST_SEED when set (a replay), else fresh."""
    env = os.environ.get(SEED_ENV)
    return int(env) if env else random.SystemRandom().randrange(1 << 32)


@pytest.fixture(autouse=True)
def _seed_everything(request: pytest.FixtureRequest):
    seed = draw_seed()
    request.node._voltserve_seed = seed
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (1 << 32))
    except ImportError:  # numpy comes with torch and numba; kept optional for clarity
        pass
    yield


@pytest.fixture
def seed(request: pytest.FixtureRequest, _seed_everything) -> int:
    """This test's seed (printed on failure, replayed with VOLTSERVE_TEST_SEED)."""
    return request.node._voltserve_seed


@pytest.fixture
def rng(seed: int) -> random.Random:
    """Fresh random inputs every run, reproducible from the test's seed."""
    return random.Random(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "_voltserve_seed", None)
    if seed is not None and report.failed:
        report.sections.append(
            ("random seed", f"replay with {SEED_ENV}={seed} pytest '{item.nodeid}'")
        )


def pytest_report_header(config) -> str:
    env = os.environ.get(SEED_ENV)
    return f"{SEED_ENV}={env} (every test replays it)" if env else "random seeds: fresh per test"


# ---- order and grouping for pytest-xdist (`make test`: -n auto --dist loadgroup) ----------

# Scheduled first, in this order: the longest work starts at once and the short tests fill in
# beside and after it, so both workers finish together. "cc70" is the compile check
# (tests/kernels/conftest.py); slow tests carry the `slow` mark.
_FIRST_GROUPS = ("cc70",)


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


# Session-scoped fixtures that are a running stack of services (tests/integration/conftest.py):
# every test that uses one is in one group, named after the fixture, so one worker starts it once.
_SHARED_STACKS = ("stack",)


def _shared_group(item: pytest.Item) -> str | None:
    """The group of a test that shares a running stack: a session-scoped one of _SHARED_STACKS,
    else the module's when it uses a module-scoped fixture; None otherwise."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in _SHARED_STACKS:
        defs = info.name2fixturedefs.get(name, ()) if name in info.names_closure else ()
        if defs and defs[-1].scope == "session":  # the closest definition (a module may override)
            return f"session-{name}"
    if any(
        d.scope in ("module", "package", "class")
        for name in info.names_closure
        for d in info.name2fixturedefs.get(name, ())
    ):
        return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A module whose tests share a module-scoped fixture (a running stack of services) stays on
    # one worker: spread over two, each would start its own copy. So do the modules that share
    # a session-scoped stack.
    for item in items:
        if _group(item) is None and (group := _shared_group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))

    def rank(item: pytest.Item) -> int:
        g = _group(item)
        if g in _FIRST_GROUPS:
            return _FIRST_GROUPS.index(g)
        n = len(_FIRST_GROUPS)
        if item.get_closest_marker("slow"):
            return n
        return n + 1 if g is not None else n + 2  # a module's shared stack, then the rest

    # Stable: a module's tests keep their order, and a module with a shared fixture (all one
    # rank) stays contiguous, so a serial run sets that fixture up once too.
    items.sort(key=rank)


def pytest_terminal_summary(terminalreporter) -> None:
    """Every failed test's replay line once more, last: a long assertion diff can push the
    report's own section out of what a CI log keeps."""
    lines = [
        text
        for rep in terminalreporter.stats.get("failed", [])
        for title, text in getattr(rep, "sections", [])
        if title == "random seed"
    ]
    if lines:
        terminalreporter.write_sep("=", "random seeds of the failed tests")
        for line in lines:
            terminalreporter.write_line(line)
