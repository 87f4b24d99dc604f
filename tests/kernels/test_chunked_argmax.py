"""chunked_argmax equals torch's argmax, ties (first index) included."""

import pytest
import torch
from voltserve.kernels.sampling.sampling import chunked_argmax


@pytest.mark.parametrize("vocab", [128256, 151936, 32000, 1000, 7])
@pytest.mark.parametrize("batch", [1, 3])
def test_chunked_argmax_equals_argmax(vocab: int, batch: int) -> None:
    g = torch.Generator().manual_seed(vocab * 10 + batch)
    # Few distinct values: many ties, across chunks and inside them.
    x = torch.randint(-4, 4, (batch, vocab), generator=g).float()
    assert torch.equal(chunked_argmax(x), x.argmax(dim=-1))
    x = torch.randn((batch, vocab), generator=g).half()
    assert torch.equal(chunked_argmax(x), x.argmax(dim=-1))
    x[:, -1] = x.max() + 1  # the max in the last chunk
    want = x.argmax(dim=-1)
    assert torch.equal(chunked_argmax(x), want)
    assert want.eq(vocab - 1).all()
