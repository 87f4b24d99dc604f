"""GPU tests share the card between pytest-xdist workers and, within a worker, between tests.

- Each worker's engines budget a 1/N share of the card (`max_gpu_memory`, as
  `--max-gpu-memory` would) unless the test sets its own: sized from the card's free memory, the
  first engine to start would otherwise take 90% of what every other worker needs.
- Each test's engines (KV caches, graph pools, reference cycles between runner and graphs) are
  released before the next test sizes its own."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from voltserve.shared.config import EngineConfig


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or not torch.cuda.is_available():
        return
    share = torch.cuda.mem_get_info()[1] // workers
    post_init = EngineConfig.__post_init__

    def capped(self: EngineConfig) -> None:
        if self.max_gpu_memory is None and self.device != "cpu":
            self.max_gpu_memory = share
        post_init(self)

    EngineConfig.__post_init__ = capped


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
