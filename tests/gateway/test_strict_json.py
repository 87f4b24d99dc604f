"""JSON never carries a bare NaN or Infinity: the gateway's encoder refuses them with a 500, a
logprob of minus infinity goes out as vLLM's floor (-9999.0), and a NaN or +infinity logprob
from an engine is refused before anything is written."""

from __future__ import annotations

import json
import math

import pytest
from voltserve.services.gateway import sse
from voltserve.services.gateway.errors import APIError
from voltserve.services.gateway.generate import LOGPROB_FLOOR, logprob_value


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_dumps_refuses_non_finite_numbers_anywhere(rng, bad) -> None:
    body = {"choices": [{"logprobs": {"token_logprobs": [rng.random() for _ in range(3)]}}]}
    row = body["choices"][0]["logprobs"]["token_logprobs"]
    row[rng.randrange(3)] = bad
    with pytest.raises(APIError) as e:
        sse.event(body)
    assert e.value.status == 500 and "JSON" in e.value.message


def test_dumps_writes_what_json_reads_back(rng) -> None:
    body = {"x": [rng.uniform(-1e6, 1e6) for _ in range(5)], "t": "é\n"}
    assert json.loads(sse.dumps(body)) == body


def test_logprob_values(rng) -> None:
    x = -rng.uniform(0, 50)
    assert logprob_value(x) == x
    assert logprob_value(-math.inf) == LOGPROB_FLOOR == -9999.0
    assert logprob_value(-1e30) == LOGPROB_FLOOR
    for bad in (math.nan, math.inf):
        with pytest.raises(APIError) as e:
            logprob_value(bad)
        assert e.value.status == 500
