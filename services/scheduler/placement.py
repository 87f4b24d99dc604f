"""Placement: the least loaded executor, unless the executor that recently served the same
prompt prefix is only a little busier (its prefix cache then saves the prefill)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from voltserve.services.scheduler.registry import ExecutorInfo

AFFINITY_BLOCK = 16  # tokens per block, as the engine's prefix cache
AFFINITY_MAX_BLOCKS = 4
AFFINITY_CAPACITY = 100_000


def prefix_keys(prompt: list[int]) -> list[bytes]:
    """Hash-chain keys of the prompt's first full blocks, shortest first."""
    keys, h = [], hashlib.blake2b(digest_size=16)
    n = min(len(prompt) // AFFINITY_BLOCK, AFFINITY_MAX_BLOCKS)
    for b in range(n):
        block = prompt[b * AFFINITY_BLOCK : (b + 1) * AFFINITY_BLOCK]
        h.update(b"|".join(str(t).encode() for t in block) + b";")
        keys.append(h.copy().digest())
    return keys


class Placement:
    def __init__(self, queue_factor: float = 2.0) -> None:
        # An executor takes up to queue_factor * max_num_seqs unfinished requests; the rest wait
        # in the scheduler, where they can still go to whichever executor frees up first.
        self.queue_factor = queue_factor
        self.affinity: OrderedDict[bytes, str] = OrderedDict()

    def capacity(self, e: ExecutorInfo) -> int:
        return max(1, int(self.queue_factor * e.max_num_seqs))

    def choose(
        self, prompt: list[int], executors: list[ExecutorInfo], load: dict[str, int]
    ) -> str | None:
        """Pick an executor id for a prompt, or None when every executor is full (or none)."""
        open_ = [e for e in executors if load.get(e.executor_id, 0) < self.capacity(e)]
        if not open_:
            return None

        def score(e: ExecutorInfo) -> tuple[float, float, str]:
            return (load.get(e.executor_id, 0) / self.capacity(e), e.kv_cache_usage, e.executor_id)

        best = min(open_, key=score)
        keys = prefix_keys(prompt)
        by_id = {e.executor_id: e for e in open_}
        for key in reversed(keys):  # longest shared prefix first
            eid = self.affinity.get(key)
            if eid is None or eid not in by_id:
                continue
            slack = max(2, self.capacity(by_id[eid]) // 8)
            if load.get(eid, 0) <= load.get(best.executor_id, 0) + slack:
                best = by_id[eid]
            break
        for key in keys:
            self.affinity[key] = best.executor_id
            self.affinity.move_to_end(key)
        while len(self.affinity) > AFFINITY_CAPACITY:
            self.affinity.popitem(last=False)
        return best.executor_id

    def forget(self, executor_id: str) -> None:
        for key in [k for k, v in self.affinity.items() if v == executor_id]:
            del self.affinity[key]
