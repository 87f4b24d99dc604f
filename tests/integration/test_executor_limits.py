"""The context length is the executor's to decide, and the gateway and the renderer hold requests
to what it published: a Mistral checkpoint whose sliding window (256) is shorter than its
max_position_embeddings (512) is served with a 256-token context everywhere. Before any
executor has published, a request gets a 503 that says why."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.checkpoints import checkpoint

from .conftest import start_stack

WINDOW = 256  # tests/checkpoints.py: mistral's sliding_window


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_listening(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            get(url + "/health")
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer in {timeout} s")


@pytest.mark.timeout(300)
def test_gateway_and_renderer_enforce_the_executors_limit(tmp_path: Path, rng) -> None:
    model = checkpoint("mistral")
    config = json.loads((model / "config.json").read_text())
    assert config["sliding_window"] == WINDOW < config["max_position_embeddings"]
    tok = AutoTokenizer.from_pretrained(model)
    stack = start_stack(model, tmp_path / "stack", executors=0, wait=False)
    try:
        url = stack.base_url()
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        wait_listening(url)

        # No executor yet: nothing is listed, and a request is refused with the reason.
        assert get(url + "/v1/models") == (200, {"object": "list", "data": []})
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2)
        assert e.value.status_code == 503
        assert "no executor has published its limits" in e.value.message

        stack.add_executor("executor-0")
        stack.wait_ready()
        assert stack.limits().max_model_len == WINDOW

        # /v1/models reports the context the executor enforces, not config.json's.
        (listed,) = client.models.list().data
        assert listed.model_extra["max_model_len"] == WINDOW

        # No max_tokens: the answer may fill the rest of the executor's context.
        words = " ".join(rng.choice(["sun", "dog", "sea", "é"]) for _ in range(rng.randint(3, 20)))
        messages = [{"role": "user", "content": words}]
        r = client.chat.completions.create(
            model="tiny", messages=messages, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens + r.usage.completion_tokens == WINDOW

        # Over the limit (but within config.json's 512): one 400 naming the limit, from the
        # gateway (ids: counted by their length) and from the renderer (text: tokenized).
        ids = [rng.randrange(3, len(tok)) for _ in range(rng.randint(WINDOW, 500))]
        text = tok.decode(ids)
        n_text = len(tok(text, add_special_tokens=True)["input_ids"])
        for prompt, n in ((ids, len(ids)), (text, n_text)):
            if n < WINDOW:
                continue  # a decode that re-tokenized shorter: not over the limit
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
            msg = e.value.message
            assert f"maximum context length is {WINDOW} tokens" in msg, msg
            assert e.value.body["param"] == "prompt"
        # An explicit max_tokens past the rest of the context, named with both lengths.
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=ids[:10], max_tokens=WINDOW)
        assert f"maximum context length is {WINDOW} tokens" in e.value.message
        assert e.value.body["param"] == "max_tokens"
    finally:
        stack.stop()
