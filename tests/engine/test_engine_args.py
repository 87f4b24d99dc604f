"""Every engine flag is declared once (services/executor/engine_args.py) and every command that
builds an engine takes all of them from there; EngineConfig is built by one function."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import pytest
from voltserve.services import launcher
from voltserve.services.executor import generate
from voltserve.services.executor import main as executor_main
from voltserve.services.executor.engine_args import (
    ENGINE_FLAGS,
    engine_argv,
    engine_config,
)
from voltserve.services.executor.spec.config import SpeculativeConfig
from voltserve.shared.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
# EngineConfig fields set only in code (tests, benchmarks), never from the command line.
NOT_FLAGS = {"cpu_kv_cache_bytes", "max_graph_batch_size"}

PARSERS = {
    "serve": launcher.build_parser,
    "executor": executor_main.build_parser,
    "generate": generate.build_parser,
}
# What each parser needs beyond the engine flags to parse.
REQUIRED = {"serve": [], "executor": [], "generate": ["--prompt", "hi"]}


def test_one_declaration_per_field() -> None:
    fields = [f.field for f in ENGINE_FLAGS]
    assert len(fields) == len(set(fields))
    names = [n for f in ENGINE_FLAGS for n in f.names]
    assert len(names) == len(set(names))
    config_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(fields) | NOT_FLAGS == config_fields
    assert not set(fields) & NOT_FLAGS


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_parser_takes_every_flag_from_the_declaration(command: str) -> None:
    parser = PARSERS[command]()
    actions = parser._option_string_actions
    for f in ENGINE_FLAGS:
        for name in f.names:
            a = actions[name]
            # The very declaration: same destination, help and type.
            assert a.dest == f.dest and a.help == f.help, (command, name)
            assert a.type is f.type, (command, name)
    # And nothing else in the parser is an EngineConfig field under another name.
    engine_dests = {f.dest for f in ENGINE_FLAGS}
    other = {a.dest for a in parser._actions} - engine_dests
    config_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not other & config_fields, (command, other & config_fields)


def random_config(rng: random.Random) -> EngineConfig:
    spec = rng.choice([None, {"method": "ngram", "num_speculative_tokens": rng.randint(1, 16)}])
    return engine_config(
        model=f"/models/m{rng.randrange(100)}",
        dtype=rng.choice(["auto", "float16", "half", "bfloat16", "float32", "float"]),
        device=rng.choice(["auto", "cpu", "cuda", "cuda:1"]),
        max_model_len=rng.choice([None, rng.randint(1, 1 << 17)]),
        max_num_seqs=rng.randint(1, 1024),
        max_num_batched_tokens=rng.randint(1, 1 << 16),
        block_size=rng.choice([16, 32]),
        num_kv_blocks=rng.choice([None, rng.randint(1, 1 << 16)]),
        gpu_memory_utilization=round(rng.uniform(0.05, 0.99), 4),
        enable_prefix_caching=rng.choice([None, True, False]),
        enforce_eager=rng.random() < 0.5,
        cuda_graph_sizes=tuple(sorted(rng.sample(range(1, 257), rng.randint(0, 5)))),
        tensor_parallel_size=rng.randint(1, 8),
        seed=rng.randrange(1 << 31),
        speculative_config=spec,
        quantization=rng.choice([None, "awq", "gptq", "compressed-tensors", "gguf"]),
        max_gpu_memory=rng.choice([None, rng.randint(1, 1 << 40)]),
    )


def test_every_field_survives_every_command(rng) -> None:
    """A config -> its flags -> each command's parser -> the builder: the same config."""
    for _ in range(20):
        want = random_config(rng)
        argv = engine_argv(want)
        for command, build in PARSERS.items():
            args = build().parse_args(argv + REQUIRED[command])
            assert engine_config(args) == want, (command, argv)


def test_serve_hands_every_field_to_each_executor(rng) -> None:
    want = dataclasses.replace(random_config(rng), tensor_parallel_size=1)
    args = launcher.build_parser().parse_args(engine_argv(want) + ["--device", "cpu"])
    want = dataclasses.replace(want, device="cpu")
    execs = [c for c in launcher.build_children(args, "redis://x") if c.name.startswith("exec")]
    assert execs
    for child in execs:
        got = engine_config(executor_main.build_parser().parse_args(child.argv[1:]))
        assert got == want


def test_builder_parses_the_speculative_config_once_and_refuses_bad_values() -> None:
    cfg = engine_config(
        model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    )
    assert cfg.speculative_config == SpeculativeConfig("ngram", 2, 1, 4)
    # A parsed one is kept as it is; the flag's text parses to the same object.
    assert engine_config(model="m", speculative_config=cfg.speculative_config) == cfg
    flag = '{"method": "ngram", "num_speculative_tokens": 2}'
    args = executor_main.build_parser().parse_args(["--model", "m", "--speculative-config", flag])
    assert engine_config(args) == cfg
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine_config(model="m", speculative_config={"method": "ngram"})
    with pytest.raises(TypeError, match="engine_config"):  # the object unparsed: refused now
        EngineConfig(model="m", speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="not EngineConfig fields"):
        engine_config(model="m", max_len=5)
    with pytest.raises(ValueError, match="dtype"):
        engine_config(model="m", dtype="int8")
    bad = '{"method": "ngram", "num_speculative_tokens": 99}'
    with pytest.raises(SystemExit):
        executor_main.build_parser().parse_args(["--model", "m", "--speculative-config", bad])
    # What a child process is given: the flag's JSON, which parses back to the same config.
    argv = engine_argv(cfg)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 4,
    }
    assert engine_config(executor_main.build_parser().parse_args(argv)) == cfg


def test_no_other_module_declares_an_engine_flag_or_builds_an_engine_config() -> None:
    # --model is every service's model folder (the gateway and renderer read its tokenizer).
    names = {n for f in ENGINE_FLAGS for n in f.names if n.startswith("--")} - {"--model"}
    declared = re.compile(r"add_argument\(\s*(?:\"-\w+\",\s*)?\"(--[\w-]+)\"")
    for path in sorted((ROOT / "services").rglob("*.py")) + sorted(
        (ROOT / "load_tests").glob("*.py")
    ):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        if path.name == "engine_args.py":
            continue
        assert "EngineConfig(" not in text, f"{rel} builds an EngineConfig itself"
        # make-demo-model's --seed seeds the random weights it writes, not an engine.
        if rel.parts[0] == "services" and path.name != "demo_model.py":
            again = names & set(declared.findall(text))
            assert not again, f"{rel} declares {sorted(again)} again"


def test_argparse_error_for_a_bad_value_names_the_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        generate.build_parser().parse_args(["--model", "m", "--prompt", "x", "--dtype", "int8"])
    assert "--dtype" in capsys.readouterr().err
