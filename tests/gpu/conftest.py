"""GPU tests share one process per xdist worker: each test's engines (KV caches, graph pools,
reference cycles between runner and graphs) are released before the next test sizes its own KV
cache from the card's free memory."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
