"""Start-up failures that a restart cannot fix end `voltserve serve` with the reason and a
non-zero exit status, instead of restarting the failing service forever while /health says
"starting"; a service that dies during start-up for another reason is retried once."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from voltserve.services import launcher
from voltserve.services.executor.loader import ModelLoadError, read_hf_config

from tests.checkpoints import copy_checkpoint
from voltserve.cli import command as voltserve_command

from .conftest import free_port


def serve(model: Path | str, timeout: float = 180) -> tuple[int, str, float]:
    """(exit status, stderr + stdout, seconds) of a `voltserve serve` on the CPU."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [*voltserve_command(), "serve", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(free_port()), "--device", "cpu"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr + proc.stdout, time.monotonic() - t0


def test_serve_exits_with_the_loaders_message_on_an_unsupported_architecture(tmp_path):
    model = copy_checkpoint("qwen2", tmp_path / "gpt2ish")
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    rc, err, seconds = serve(model)
    assert rc != 0, err
    # The loader's own message, on stderr, from the executor and repeated by the launcher.
    assert "unsupported architecture ['GPT2LMHeadModel']" in err, err
    assert "voltserve serve: executor-0 cannot start: unsupported architecture" in err, err
    assert "restarting" not in err, err  # not retried: the same folder fails the same way
    # Seconds of its own work: the executor's imports and config.json, no weights, no retry
    # (a 2-core machine shared with other test processes needs the margin).
    assert seconds < 120, seconds


def test_serve_refuses_a_model_path_that_does_not_exist(tmp_path):
    rc, err, seconds = serve(tmp_path / "nowhere")
    assert rc == 1
    assert f"--model {tmp_path / 'nowhere'} does not exist" in err, err
    assert seconds < 60


def test_a_gguf_file_is_not_reported_as_a_missing_folder(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    with pytest.raises(ModelLoadError, match="is a GGUF file, not a model folder") as e:
        read_hf_config(gguf)
    assert "does not exist" not in str(e.value)
    rc, err, _ = serve(gguf)
    assert rc != 0
    assert "does not exist" not in err and "cannot start" in err, err


def test_a_service_that_dies_during_start_up_is_retried_once():
    # A child that exits at once with an ordinary error (here: an unknown command) before the
    # stack was ever ready: started twice, then everything stops with status 1.
    child = launcher.Child("broken", ["no-such-command"])
    sup = launcher.Supervisor([child], f"http://127.0.0.1:{free_port()}/health")
    starts = []
    original = child.start

    def counting_start() -> None:
        starts.append(time.monotonic())
        original()

    child.start = counting_start
    t0 = time.monotonic()
    assert sup.run() == 1
    assert len(starts) == 1 + launcher.STARTUP_RETRIES
    assert time.monotonic() - t0 < 60
