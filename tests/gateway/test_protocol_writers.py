"""The Responses and Messages stream writers' framing, and what neither integration test can
make the real services do on demand: an error after a stream began, and each stop reason."""

from __future__ import annotations

import json

import pytest
from voltserve.services.gateway.chat_bridge import Ending, Usage
from voltserve.services.gateway.errors import APIError
from voltserve.services.gateway.messages_output import MessageBuilder, MessagesStream, stop_reason
from voltserve.services.gateway.responses_output import ResponseBuilder, ResponsesStream

ECHO = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "reasoning": {"effort": None, "summary": None},
    "temperature": 1.0,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": 1.0,
    "user": None,
}


def _events(data: bytes) -> list[tuple[str, dict]]:
    """`event: NAME` / `data: JSON` frames -> (name, object), checking the framing."""
    out = []
    for frame in data.decode().split("\n\n")[:-1]:
        name, payload = frame.split("\n")
        assert name.startswith("event: ") and payload.startswith("data: "), frame
        out.append((name[len("event: ") :], json.loads(payload[len("data: ") :])))
    assert data.endswith(b"\n\n")
    return out


def test_responses_error_after_the_stream_began() -> None:
    w = ResponsesStream(ResponseBuilder("resp_1", "m", ECHO, tokenizer=None))
    start = _events(w.start(Usage(5, 0, 0)))
    err = _events(w.error(APIError(503, "the executor went away")))
    assert [n for n, _ in start + err] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    assert [o["sequence_number"] for _, o in start + err] == [0, 1, 2, 3]
    assert all(n == o["type"] for n, o in start + err)
    assert err[0][1]["message"] == "the executor went away" and err[0][1]["code"] == "503"
    failed = err[1][1]["response"]
    assert failed["status"] == "failed" and failed["id"] == "resp_1"
    assert failed["error"] == {"code": "503", "message": "the executor went away"}


def test_messages_error_after_the_stream_began() -> None:
    w = MessagesStream(MessageBuilder("msg_1", "m", thinking_omitted=False))
    [(name, start)] = _events(w.start(Usage(7, 3, 4)))
    assert name == "message_start" and start["message"]["usage"] == {
        "input_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 0,
    }
    [(name, err)] = _events(w.error(APIError(400, "bad", param="max_tokens")))
    assert name == "error"
    assert err == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: bad"},
    }


@pytest.mark.parametrize(
    "finish, stop, calls, reason",
    [
        ("stop", None, 0, "end_turn"),
        ("length", None, 0, "max_tokens"),
        ("length", None, 1, "max_tokens"),  # a call cut off is not a finished call
        ("stop", None, 2, "tool_use"),
        ("stop", "END", 0, "stop_sequence"),
    ],
)
def test_stop_reasons(finish, stop, calls, reason) -> None:
    assert stop_reason(Ending(finish, stop, calls, Usage(1, 1, 0))) == reason
