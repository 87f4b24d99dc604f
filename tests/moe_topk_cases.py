"""Router logits for the MoE top-k kernel's tests (simulator: tests/kernels/test_moe_sim.py; GPU:
tests/gpu/test_moe_gpu.py) whose top-k is fixed by the logits alone, so the kernel's expert ids
can be asserted exactly on every draw.

Logits are eighths in [-8, 8]: two distinct logits are at least 1/8 apart, so their fp32
probabilities differ by a factor of at least e^(1/8) however a softmax rounds its exp and its sum,
and only equal logits give equal probabilities. Those are the ties, and the kernel's rule for them
is the lowest expert index (torch.topk leaves their order open). Rows cycle through three kinds:

- 0: the row's largest logit repeated at a second expert (a tie for first place);
- 1: about a quarter of the experts, expert 0 among them, at -inf (probability 0);
- 2: two experts at a huge logit (probability 1/2 each) and one at -inf: every other expert's
  probability underflows to exactly 0, so past the first two slots the top-k is a tie at 0.
"""

from __future__ import annotations

import torch

HUGE = {torch.float16: 60000.0, torch.float32: 1e30}  # each exactly representable


def router_logits(gen: torch.Generator, T: int, E: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, E] logits on the CPU in dtype (move them to the device after), kinds as above."""
    x = torch.randint(-64, 65, (T, E), generator=gen).float() / 8
    for r in range(T):
        perm = torch.randperm(E, generator=gen).tolist()
        kind = r % 3
        if kind == 0 and E > 1:
            top = int(x[r].argmax())
            other = perm[0] if perm[0] != top else perm[1]
            x[r, other] = x[r, top]
        elif kind == 1:
            x[r, [0] + perm[: E // 4]] = float("-inf")
        elif kind == 2 and E > 2:
            x[r, perm[:2]] = HUGE[dtype]
            x[r, perm[2]] = float("-inf")
    return x.to(dtype)


def topk_by_rule(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] int32 expert ids: descending probability, equal probabilities by expert index."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k].int()


def weight_tolerance(rounded: bool) -> dict[str, float]:
    """assert_close bounds for the kernel's weights against moe_topk_ref: a few fp32 ulps (exp,
    sum order), or one fp16 ulp (< 2^-10 relative) where both round a value that sits on either
    side of an fp16 rounding boundary."""
    return dict(rtol=1e-3, atol=1e-6) if rounded else dict(rtol=1e-5, atol=1e-7)
