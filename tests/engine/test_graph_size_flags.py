"""--cuda-graph-sizes from `voltserve serve` through the executor's flags into EngineConfig, and
the flag's errors (argparse exits with a message, never a traceback)."""

from __future__ import annotations

import pytest
from voltserve.services import launcher
from voltserve.services.executor import main as executor_main


def test_serve_passes_graph_sizes_to_every_executor():
    args = launcher.build_parser().parse_args(
        ["--model", "m", "--executors", "2", "--cuda-graph-sizes", "1,8,64"]
    )
    execs = [c for c in launcher.build_children(args, "redis://x") if c.name.startswith("exec")]
    assert len(execs) == 2
    for child in execs:
        i = child.argv.index("--cuda-graph-sizes")
        assert child.argv[i + 1] == "1,8,64"
        parsed = executor_main.build_parser().parse_args(child.argv[1:])
        assert executor_main.engine_config(parsed).cuda_graph_sizes == (1, 8, 64)


def test_executor_default_and_bad_graph_sizes(capsys):
    parsed = executor_main.build_parser().parse_args(["--model", "m"])
    assert executor_main.engine_config(parsed).cuda_graph_sizes == ()
    for bad in ("0,8", "8,x", ","):
        with pytest.raises(SystemExit):
            executor_main.build_parser().parse_args(["--model", "m", "--cuda-graph-sizes", bad])
        assert "--cuda-graph-sizes" in capsys.readouterr().err
