"""The scheduler and executors as real processes, driven at the stream level: the test plays the
gateway (EngineRequests into vs:sched, StepOutputs out of vs:gw:{id})."""

from __future__ import annotations

import random
import time
import uuid

import pytest
import redis
from voltserve.shared import streams
from voltserve.shared.protocol import (
    AbortRequest,
    EngineRequest,
    RequestError,
    StepOutput,
    decode,
    encode,
)

from .conftest import Stack

VOCAB = 384


class FakeGateway:
    """Sends engine requests and checks every request's token stream is gap- and repeat-free."""

    def __init__(self, url: str) -> None:
        self.r = redis.Redis.from_url(url)
        self.id = "gw-" + uuid.uuid4().hex[:6]
        self.r.sadd(streams.gateways_key(), self.id)
        self.pos = "0"
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.errors: dict[str, RequestError] = {}
        self.executors: dict[str, str] = {}

    def send(self, prompt: list[int], max_tokens: int, rid: str | None = None) -> str:
        rid = rid or uuid.uuid4().hex
        sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "seed": 1}
        req = EngineRequest(rid, self.id, prompt, sampling, time.time())
        self.r.xadd(streams.sched_stream(), {b"d": encode(req)})
        self.tokens[rid] = []
        return rid

    def abort(self, ids: list[str]) -> None:
        self.r.xadd(streams.sched_stream(), {b"d": encode(AbortRequest(ids))})

    def poll(self, block_ms: int = 100) -> None:
        resp = self.r.xread({streams.gw_stream(self.id): self.pos}, block=block_ms, count=500)
        for _, entries in resp or []:
            for msg_id, fields in entries:
                self.pos = msg_id
                msg = decode(fields[b"d"])
                if isinstance(msg, RequestError):
                    self.errors[msg.request_id] = msg
                    continue
                assert isinstance(msg, StepOutput)
                for d in msg.deltas:
                    toks = self.tokens[d.request_id]
                    assert d.request_id not in self.finish, f"delta after finish: {d}"
                    # The gateway's rule: drop what was already delivered; a gap is a bug.
                    assert d.output_offset <= len(toks), f"gap: {d.output_offset} > {len(toks)}"
                    toks.extend(d.token_ids[len(toks) - d.output_offset :])
                    if d.token_ids:
                        self.executors[d.request_id] = msg.executor_id
                    if d.finish_reason:
                        self.finish[d.request_id] = d.finish_reason

    def wait(self, ids, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(i in self.finish or i in self.errors for i in ids):
            assert time.monotonic() < deadline, f"unfinished: {set(ids) - set(self.finish)}"
            self.poll()


def prompt(rng: random.Random, n: int | None = None) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n or rng.randrange(4, 30))]


def wait_leader(url: str, name: str) -> redis.Redis:
    """Wait until scheduler `name` holds the lease; a client of that Redis."""
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + 60
    while r.get(streams.scheduler_lease_key()) != name.encode():
        assert time.monotonic() < deadline, f"{name} did not take the lease"
        time.sleep(0.05)
    return r


@pytest.fixture
def bare(tiny_model, tmp_path):
    s = Stack(tiny_model, tmp_path)
    yield s
    s.stop()


def test_requests_wait_for_an_executor_and_the_bound_answers_503(rng, bare):
    bare.add_scheduler("scheduler-0", "--max-queued-requests", "3")
    gw = FakeGateway(bare.redis_url)
    time.sleep(1.0)  # the scheduler takes the lease
    ids = [gw.send(prompt(rng), 6) for _ in range(5)]
    deadline = time.monotonic() + 60
    while len(gw.errors) < 2:
        assert time.monotonic() < deadline
        gw.poll()
    assert sorted(gw.errors) == sorted(ids[3:])
    for e in gw.errors.values():
        assert e.status == 503 and "--max-queued-requests=3" in e.message
    gw.poll(300)
    assert not gw.finish  # no executor yet: the first three wait
    bare.add_executor("executor-0")
    gw.wait(ids[:3])
    assert all(gw.finish[i] == "length" and len(gw.tokens[i]) == 6 for i in ids[:3])


def test_abort_reaches_the_executor_and_the_queue(rng, bare):
    bare.add_scheduler()
    gw = FakeGateway(bare.redis_url)
    queued = gw.send(prompt(rng), 5)
    time.sleep(1.0)
    gw.abort([queued])  # still in the admission queue: the scheduler ends it itself
    gw.wait([queued])
    assert gw.finish[queued] == "abort" and gw.tokens[queued] == []
    bare.add_executor("executor-0")
    bare.wait_executor("executor-0", alive=True)
    long = gw.send(prompt(rng), 400)
    while len(gw.tokens[long]) < 5:
        gw.poll()
    gw.abort([long])
    gw.wait([long])
    assert gw.finish[long] == "abort"
    assert len(gw.tokens[long]) < 400


def test_burst_admitted_as_a_batch_is_recorded_and_an_abort_in_it_stays_final(rng, bare):
    """Requests the scheduler reads in one batch are admitted together and recorded before the
    batch is acknowledged (its route records appear while no executor can take them); a
    request aborted in the same batch ends as aborted and leaves no record behind."""
    bare.add_scheduler("scheduler-0")
    r = wait_leader(bare.redis_url, "scheduler-0")
    gw = FakeGateway(bare.redis_url)
    n = rng.randint(5, 20)
    reqs = []
    for _ in range(n):
        rid = uuid.uuid4().hex
        sampling = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "seed": 1}
        reqs.append(EngineRequest(rid, gw.id, prompt(rng), sampling, time.time()))
        gw.tokens[rid] = []
    victim = reqs[rng.randrange(n)].request_id
    # One transaction: the blocked XREADGROUP sees every entry at once (one batch).
    with r.pipeline(transaction=True) as p:
        for req in reqs:
            p.xadd(streams.sched_stream(), {b"d": encode(req)})
        p.xadd(streams.sched_stream(), {b"d": encode(AbortRequest([victim]))})
        p.execute()
    gw.wait([victim])
    assert gw.finish[victim] == "abort"
    deadline = time.monotonic() + 10
    while r.hlen(streams.scheduler_routes_key()) < n - 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    keys = {k.decode() for k in r.hkeys(streams.scheduler_routes_key())}
    assert keys == {q.request_id for q in reqs} - {victim}
    bare.add_executor("executor-0")
    live = [q.request_id for q in reqs if q.request_id != victim]
    gw.wait(live)
    assert all(len(gw.tokens[i]) == 4 for i in live)


def test_prefix_affinity_and_least_loaded(rng, bare):
    bare.add_scheduler()
    bare.add_executor("executor-0")
    bare.add_executor("executor-1")
    bare.wait_executor("executor-0", alive=True)
    bare.wait_executor("executor-1", alive=True)
    time.sleep(0.5)  # the scheduler's registry sees both
    gw = FakeGateway(bare.redis_url)
    shared = prompt(rng, 48)
    same = [gw.send(shared + prompt(rng), 30) for _ in range(6)]
    gw.wait(same)
    assert len({gw.executors[i] for i in same}) == 1  # all where the prefix is cached
    time.sleep(0.6)  # the scheduler learns of finishes by tailing our stream (<= 0.2 s late)
    spread = [gw.send(prompt(rng, 40), 30) for _ in range(6)]
    gw.wait(spread)
    assert {gw.executors[i] for i in spread} == {"executor-0", "executor-1"}


def test_standby_scheduler_takes_over_queued_requests(rng, bare):
    bare.add_scheduler("scheduler-0")
    r = wait_leader(bare.redis_url, "scheduler-0")
    bare.add_scheduler("scheduler-1")
    gw = FakeGateway(bare.redis_url)
    ids = [gw.send(prompt(rng), 7) for _ in range(4)]
    deadline = time.monotonic() + 10
    while r.hlen(streams.scheduler_routes_key()) < 4:  # admitted and mirrored
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert r.get(streams.scheduler_lease_key()) == b"scheduler-0"
    bare.kill("scheduler-0")
    bare.add_executor("executor-0")
    gw.wait(ids)
    assert r.get(streams.scheduler_lease_key()) == b"scheduler-1"
    assert all(len(gw.tokens[i]) == 7 for i in ids)
    # New requests are served by the new leader too.
    more = [gw.send(prompt(rng), 3) for _ in range(3)]
    gw.wait(more)
    deadline = time.monotonic() + 5
    while r.hlen(streams.scheduler_routes_key()):  # it forgets finished requests (tail lag)
        assert time.monotonic() < deadline, r.hkeys(streams.scheduler_routes_key())
        time.sleep(0.05)
    r.close()


def test_requests_of_a_vanished_gateway_are_aborted(rng, bare):
    bare.add_scheduler()
    gw = FakeGateway(bare.redis_url)
    ids = [gw.send(prompt(rng), 5) for _ in range(3)]  # queued: there is no executor
    # Beat until the scheduler has admitted them and seen us alive, then fall silent.
    deadline = time.monotonic() + 30
    while gw.r.hlen(streams.scheduler_routes_key()) < 3:
        assert time.monotonic() < deadline
        gw.r.set(streams.gateway_alive_key(gw.id), b"1", px=1500)
        time.sleep(0.2)
    gw.r.set(streams.gateway_alive_key(gw.id), b"1", px=1500)
    time.sleep(1.2)  # the scheduler checks gateways every second
    gw.wait(ids)
    assert all(gw.finish[i] == "abort" for i in ids)
    r = redis.Redis.from_url(bare.redis_url)
    assert r.hlen(streams.scheduler_routes_key()) == 0
    r.close()
