"""The attention launchers' shared argument checks (attention_common.check_paged_cache): the
decode, prefill and flash prefill launchers call it before any launch, so bad caches and index
dtypes are refused with a named reason on any machine."""

from __future__ import annotations

import pytest
import torch
from voltserve.kernels.attention.common import check_paged_cache


def _args(D=64, dtype=torch.float16):
    q = torch.zeros(3, 4, D, dtype=dtype)
    k = torch.zeros(5, 2, 16, D, dtype=dtype)
    return q, k, k.clone()


def test_accepts_a_well_formed_cache():
    q, k, v = _args()
    check_paged_cache(q, k, v, 16, block_tables=torch.zeros(1, 2, dtype=torch.int32))


@pytest.mark.parametrize(
    "bad,kind,match",
    [
        (lambda q, k, v: (q, k[:, :, :8], v[:, :, :8]), ValueError, "does not match"),
        (lambda q, k, v: (q, k, v[:4]), ValueError, "does not match"),
        (lambda q, k, v: (q[..., :32], k, v), ValueError, "does not match"),
        (lambda q, k, v: (q.float(), k, v), TypeError, "fp16 only"),
        (lambda q, k, v: (q, k.transpose(0, 1), v.transpose(0, 1)), ValueError, "contiguous"),
    ],
)
def test_refuses_bad_caches(bad, kind, match):
    with pytest.raises(kind, match=match):
        check_paged_cache(*bad(*_args()), 16)


def test_names_the_index_tensor_that_is_not_int32():
    q, k, v = _args()
    with pytest.raises(TypeError, match="seq_lens must be int32"):
        check_paged_cache(
            q,
            k,
            v,
            16,
            block_tables=torch.zeros(1, 2, dtype=torch.int32),
            seq_lens=torch.zeros(1, dtype=torch.int64),
        )
