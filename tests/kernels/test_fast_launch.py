"""fast_launch's host-side rules against numba's own: the layout numba gives an array of a shape
and byte strides (numba's dummyarray flags), and the C-contiguous strides it uses for a tensor
the CUDA array interface describes without strides. Random shapes and strides; the seed is
printed."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numba_cuda
import numpy as np
import torch
from voltserve.kernels.runtime.fast_launch import c_strides, numba_layout, tensor_params


def _numba_module(rel: str):
    """A module of numba-cuda's real CUDA target by file (under the simulator, the CPU test path,
    numba.cuda is the simulator's package, whose dummyarray is a stub)."""
    path = Path(numba_cuda.__file__).parent / "numba" / "cuda" / rel
    spec = importlib.util.spec_from_file_location(f"_real_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


dummyarray = _numba_module("cudadrv/dummyarray.py")
api_util = _numba_module("api_util.py")


def _numba_layout(shape, strides, itemsize):
    flags = dummyarray.Array.from_desc(0, shape, strides, itemsize).flags
    return "C" if flags["C_CONTIGUOUS"] else "F" if flags["F_CONTIGUOUS"] else "A"


def test_layout_matches_numba():
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for _ in range(3000):
        nd = rng.randint(1, 4)
        shape = tuple(rng.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(nd))
        item = rng.choice([1, 2, 4, 8])
        if rng.random() < 0.5:  # a real view: C or F order, maybe sliced or transposed
            arr = np.empty([max(1, n) * 2 for n in shape], dtype=f"u{item}")
            arr = arr[tuple(slice(0, n, rng.choice([1, 2])) for n in shape)]
            if rng.random() < 0.3:
                arr = arr.T
            shape, strides = arr.shape, arr.strides
        else:
            strides = tuple(rng.choice([0, item, 2 * item, 8 * item, 64 * item]) for _ in shape)
        assert numba_layout(shape, strides, item) == _numba_layout(shape, strides, item), (
            shape,
            strides,
            item,
        )


def test_c_strides_and_params():
    for shape in [(3,), (4, 5), (2, 1, 7), (1,), (6, 0, 2)]:
        want = api_util.prepare_shape_strides_dtype(shape, None, np.float16, "C")[1]
        assert c_strides(shape, 2) == list(want)
    t = torch.arange(24, dtype=torch.float16).reshape(4, 6)
    assert tensor_params(t) == [0, 0, 24, 2, t.data_ptr(), 4, 6, 12, 2]
    v = t[:, ::2]  # not contiguous: torch's strides, in bytes
    assert tensor_params(v) == [0, 0, 12, 2, v.data_ptr(), 4, 3, 12, 4]
