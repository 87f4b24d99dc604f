"""Real-shape checkpoints and the serving check of tests/gpu/test_real_shapes_gpu.py: a real
model's vocabulary and widths with two layers, in every weight format, served by `voltserve
serve` at its default flags and compared, token by token, with transformers in fp32 on the
checkpoint's own dequantized weights. tests/load/test_real_shapes_smoke.py runs the same code
at a tiny shape on the CPU.

Building. The float folder of a shape is the random-weight checkpoint of
load_tests/common.py (`write_random_checkpoint`: a preset's config with some fields replaced,
its synthetic tokenizer covering every id); every format is written from it by the repository's
own writers: AWQ, GPTQ and compressed-tensors by tests/quant_checkpoints.py (with their
independent dequantized references), GGUF by load_tests/make_gguf_checkpoint.py (llama.cpp's
Q4_K_M mix or its Q8_0 file; the reference is the .gguf file itself, which transformers
dequantizes with the gguf package). `Builds` writes every case a session needs at once, on the
CPU, in threads beside the running cases (numpy and torch release the GIL; the GPU stays the
server's), each once per folder.

Checking (`serve_and_check`). Two sets of requests against one server, completions API,
prompts as token ids, greedy, `ignore_eos`, logprobs of the chosen tokens:
1. `batch` concurrent prompts of random length in [short_min, short_max], then at once one
   prompt of `long_prompt` tokens: it is admitted behind them, so its prefill runs in chunks
   beside their prefills and decodes (the step budget, max-num-batched-tokens, is 8192);
2. `batch` other prompts alone: after their prefills every step decodes exactly `batch`
   sequences (the decode graph of that batch size).
Every request must finish with finish_reason "length" after max_tokens tokens. Random weights
make near-ties common at a 128K vocabulary (the top two logits of 128,256 draws are ~0.26
apart on average here), so greedy is checked teacher-forced: transformers runs over each prompt
and the server's tokens, and at every generated position the server's token must be within
`tol` of the reference's best logit, and its logprob within `tol` of the reference's.
"""

from __future__ import annotations

import contextlib
import gc
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from load_tests import common
from load_tests import make_gguf_checkpoint as make_gguf
from load_tests.serve_stack import ServeStack
from tests import fp4_checkpoints as fc
from tests import quant_checkpoints as qc

# Seed of every float folder's random weights (the prompts come from each test's seed).
WEIGHTS_SEED = 0
LAYERS = 2
# transformers builds a model under torch's default dtype, which it sets for the whole process:
# one model built at a time (the float folders' fp16, the references' fp32).
_MODEL_BUILD = threading.Lock()


@dataclass(frozen=True)
class Shape:
    """A preset of load_tests/common.py with some config fields replaced."""

    preset: str
    overrides: tuple[tuple[str, Any], ...]

    @property
    def config(self) -> dict[str, Any]:
        return common.PRESETS[self.preset] | dict(self.overrides)


SHAPES: dict[str, Shape] = {
    # vocabulary 128,256, hidden 4096, intermediate 14,336, 32 heads over 8 KV heads of 128
    "llama3-8b": Shape("llama3-8b", (("num_hidden_layers", LAYERS),)),
    # vocabulary 152,064, hidden 3584, intermediate 18,944, 28 heads over 4 of 128, qkv bias
    "qwen2.5-7b": Shape("qwen2.5-7b", (("num_hidden_layers", LAYERS),)),
    # Gemma 3's 262,144-token vocabulary on the Llama-3-8B widths (a llama config)
    "vocab262k": Shape("llama3-8b", (("num_hidden_layers", LAYERS), ("vocab_size", 262144))),
    # The CPU smoke test's: every linear's input a whole number of K-quant super-blocks (256)
    # and of AWQ / GPTQ groups (128)
    "tiny-llama": Shape(
        "tiny", (("hidden_size", 256), ("intermediate_size", 512), ("vocab_size", 1024))
    ),
    "tiny-qwen2": Shape(
        "qwen2.5-0.5b",
        (
            ("hidden_size", 256),
            ("intermediate_size", 512),
            ("num_hidden_layers", LAYERS),
            ("num_attention_heads", 4),
            ("num_key_value_heads", 2),
            ("vocab_size", 1024),
            ("max_position_embeddings", 2048),
            ("tie_word_embeddings", False),
            ("bos_token_id", 1),
            ("eos_token_id", 2),
        ),
    ),
}

# fp16 safetensors; AWQ int4 g128 (zero points); GPTQ int4 g128 act-order (symmetric, v1);
# compressed-tensors W4A16 g128 (pack-quantized, symmetric); GGUF: llama.cpp's Q4_K_M mix (Q6_K
# output.weight, Q4_K token_embd, Q4_K / Q6_K layers) and Q8_0 (token_embd and output too);
# compressed-tensors NVFP4 and MXFP4 weights (nvfp4- / mxfp4-pack-quantized, the library's own
# scale rules and compressor: tests/fp4_checkpoints.py).
FORMATS = ("fp16", "awq", "gptq", "ct", "gguf-q4_k_m", "gguf-q8_0", "ct-nvfp4", "ct-mxfp4")


@dataclass(frozen=True)
class Built:
    model: Path  # what `voltserve serve --model` takes (a folder, or a .gguf file)
    tokenizer: Path | None  # --tokenizer, where the model has no usable one (a GGUF file)
    reference: Path  # what transformers loads for the expected logits
    reference_kwargs: dict[str, str]  # {"gguf_file": ...} for a GGUF file
    vocab_size: int


def float_folder(root: Path, shape: str) -> Path:
    """The fp16 random-weight folder of `shape` under root (written unless its marker says it
    holds exactly that already)."""
    s = SHAPES[shape]
    out = root / shape
    over = dict(s.overrides)
    if not common.checkpoint_matches(out, s.preset, over):
        with _MODEL_BUILD:
            common.write_random_checkpoint(
                out, s.preset, "cpu", torch.float16, seed=WEIGHTS_SEED, overrides=over
            )
    return out


def _outputs(root: Path, shape: str, fmt: str) -> list[Path]:
    """Folders a build of (shape, fmt) writes (the quant writers name theirs by their settings)."""
    word = {"awq": "awq-", "gptq": "gptq-", "ct": "ct-w"}.get(fmt, fmt)
    return sorted(root.glob(f"{shape}-{word}*"))


def build(root: Path, shape: str, fmt: str) -> Built:
    """Write (shape, fmt) under root, from the shape's float folder. On the CPU."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {FORMATS}")
    src = float_folder(root, shape)
    arch = SHAPES[shape].config["model_type"]
    vocab = SHAPES[shape].config["vocab_size"]
    if fmt == "fp16":
        return Built(src, None, src, {}, vocab)
    if fmt.startswith("gguf-"):
        if arch != "llama":
            raise ValueError(f"{shape}: GGUF files are written for llama shapes only")
        f = root / f"{shape}-{fmt}" / "model.gguf"
        make_gguf.convert(src, f, fmt.removeprefix("gguf-"), "cpu")
        # the file's tokens are the word-level tokenizer's, which GGUF cannot express exactly
        return Built(f, src, f.parent, {"gguf_file": f.name}, vocab)
    if fmt == "awq":
        q, ref = qc.awq_checkpoint(arch, 128, src=src)
    elif fmt == "gptq":
        q, ref = qc.gptq_checkpoint(arch, 4, 128, desc_act=True, sym=True, src=src)
    elif fmt in ("ct-nvfp4", "ct-mxfp4"):
        q, ref = fc.ct_fp4_checkpoint(arch, fmt.removeprefix("ct-"), src=src)
    else:
        q, ref = qc.ct_checkpoint(arch, 4, 128, src=src)
    return Built(q, None, ref, {}, vocab)


def import_compressed_tensors() -> None:
    """Every compressed-tensors module the ct writers use, imported in this thread."""
    import compressed_tensors.compressors.mxfp4.base  # noqa: F401
    import compressed_tensors.compressors.nvfp4.base  # noqa: F401
    import compressed_tensors.compressors.nvfp4.helpers  # noqa: F401
    import compressed_tensors.compressors.pack_quantized.base  # noqa: F401
    import compressed_tensors.quantization  # noqa: F401
    import compressed_tensors.quantization.lifecycle.forward  # noqa: F401
    import compressed_tensors.quantization.utils.helpers  # noqa: F401


class Builds:
    """Every case of a session built once, in `workers` threads started by start(); get() waits
    for one. A case's outputs count only once its marker is written: a build that stopped half
    way (a kept root, VOLTSERVE_REAL_SHAPES_DIR) is written again."""

    def __init__(self, root: Path, workers: int = 4) -> None:
        self.root = root
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="real-shapes-build")
        self.futures: dict[tuple[str, str], Future[Built]] = {}
        self.folder_locks = {shape: threading.Lock() for shape in SHAPES}

    def start(self, cases: list[tuple[str, str]]) -> None:
        if any(fmt.startswith("ct") for _, fmt in cases):
            # compressed-tensors' compressor modules import each other: imported by two build
            # threads at once, one of them finds the other's module half initialised.
            import_compressed_tensors()
        for case in cases:
            if case not in self.futures:
                self.futures[case] = self.pool.submit(self._build, *case)

    def get(self, shape: str, fmt: str) -> Built:
        self.start([(shape, fmt)])
        return self.futures[(shape, fmt)].result()

    def _build(self, shape: str, fmt: str) -> Built:
        with self.folder_locks[shape]:  # one writer per float folder
            float_folder(self.root, shape)
        marker = self.root / f"{shape}-{fmt}.built.json"
        if marker.is_file():
            d = json.loads(marker.read_text())
            return Built(
                Path(d["model"]),
                Path(d["tokenizer"]) if d["tokenizer"] else None,
                Path(d["reference"]),
                d["reference_kwargs"],
                d["vocab_size"],
            )
        if fmt != "fp16":
            for stale in _outputs(self.root, shape, fmt):
                if stale.is_dir():
                    shutil.rmtree(stale)
                else:
                    stale.unlink()
        b = build(self.root, shape, fmt)
        d = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(b).items()}
        marker.write_text(json.dumps(d))
        return b

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def load_reference(built: Built) -> torch.nn.Module:
    """transformers' model of the checkpoint's dequantized weights, fp32, on the CPU."""
    from transformers import AutoModelForCausalLM

    with _MODEL_BUILD:
        model = AutoModelForCausalLM.from_pretrained(
            built.reference, dtype=torch.float32, **built.reference_kwargs
        )
    if {p.dtype for p in model.parameters()} != {torch.float32}:
        raise RuntimeError(f"{built.reference}: the reference did not load in fp32")
    return model.eval()


# ---- serving --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    long_prompt: int  # the one long prompt's tokens
    batch: int  # concurrent requests of each set
    short_min: int  # prompt lengths of the batch, drawn in [short_min, short_max]
    short_max: int
    max_tokens: int  # generated per request, greedy


@dataclass
class Completion:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Report:
    """One case's outcome: what failed (empty: passed), timings and the largest differences
    from the reference."""

    problems: list[str] = field(default_factory=list)
    requests: int = 0
    serve_ready_s: float | None = None
    requests_s: float | None = None
    reference_s: float | None = None
    max_gap: float = 0.0  # reference's best logit - its logit of the server's token
    max_logprob_diff: float = 0.0
    server_log_tail: str | None = None


def _complete(url: str, model: str, c: Completion, max_tokens: int) -> None:
    body = {
        "model": model,
        "prompt": c.prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            choice = json.loads(r.read())["choices"][0]
    except urllib.error.HTTPError as e:
        c.error = f"HTTP {e.code}: {e.read()[:500]!r}"
        return
    except OSError as e:
        c.error = f"{type(e).__name__}: {e}"
        return
    lp = choice["logprobs"]
    c.tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    c.logprobs = [float(x) for x in lp["token_logprobs"]]
    c.finish_reason = choice["finish_reason"]


def _send_all(url: str, model: str, sets: list[list[Completion]], max_tokens: int) -> None:
    """Each set's requests at once (in order), one set after the other."""
    for requests in sets:
        with ThreadPoolExecutor(len(requests)) as pool:
            for f in [pool.submit(_complete, url, model, c, max_tokens) for c in requests]:
                f.result()


def requests_for(rng, sizes: Sizes, vocab: int) -> list[list[Completion]]:
    """The two sets: batch short prompts then the long one; batch other short prompts. Ids
    below 16 are left out (special tokens in real vocabularies)."""

    def prompt(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    def shorts() -> list[Completion]:
        return [
            Completion(prompt(rng.randint(sizes.short_min, sizes.short_max)))
            for _ in range(sizes.batch)
        ]

    return [shorts() + [Completion(prompt(sizes.long_prompt))], shorts()]


def _wait_for_device_memory(device: torch.device, nbytes: int, timeout_s: float = 60.0) -> None:
    """The server's processes give their GPU memory back as they exit: wait until nbytes are
    free before the reference moves there."""
    if device.type != "cuda":
        return
    deadline = time.monotonic() + timeout_s
    while torch.cuda.mem_get_info(device)[0] < nbytes and time.monotonic() < deadline:
        time.sleep(0.5)


def reference_problems(
    model: torch.nn.Module, c: Completion, max_tokens: int, tol: float, report: Report
) -> list[str]:
    """What is wrong with one completion: its finish, its length, and at each generated
    position the server's token and logprob against the reference run over prompt + the
    server's tokens (teacher-forced)."""
    if c.error is not None:
        return [f"request failed: {c.error}"]
    out = []
    if c.finish_reason != "length":
        out.append(f"finish_reason {c.finish_reason!r}, not 'length'")
    if len(c.tokens) != max_tokens or len(c.logprobs) != max_tokens:
        return [*out, f"{len(c.tokens)} tokens and {len(c.logprobs)} logprobs, not {max_tokens}"]
    device = next(model.parameters()).device
    ids = torch.tensor([c.prompt + c.tokens[:-1]], device=device)
    with torch.no_grad():
        logits = model(ids, logits_to_keep=max_tokens).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    best = logits.max(dim=-1)
    for i, t in enumerate(c.tokens):
        gap = (best.values[i] - logits[i, t]).item()
        diff = abs(lp[i, t].item() - c.logprobs[i])
        report.max_gap = max(report.max_gap, gap)
        report.max_logprob_diff = max(report.max_logprob_diff, diff)
        if gap > tol:
            out.append(
                f"position {i}: token {t} is {gap:.3f} below the reference's best "
                f"({best.indices[i].item()}), more than {tol}"
            )
        if diff > tol:
            out.append(
                f"position {i}: logprob {c.logprobs[i]:.4f}, the reference's {lp[i, t].item():.4f}"
            )
    return out


def serve_and_check(
    built: Built,
    workdir: Path,
    sizes: Sizes,
    rng,
    tol: float,
    device: torch.device,
    references: ThreadPoolExecutor,
) -> Report:
    """Serve `built` at the default flags (the tokenizer added where the model has none), send
    the two sets of requests, stop the server, then check every completion against the
    reference on `device`. The reference loads on the CPU in `references` meanwhile."""
    report = Report()
    sets = requests_for(rng, sizes, built.vocab_size)
    ref_future = references.submit(load_reference, built)
    extra = ["--tokenizer", str(built.tokenizer)] if built.tokenizer else []
    stack = ServeStack(built.model, workdir, extra, start_timeout_s=900, gpu=device.type == "cuda")
    t0 = time.perf_counter()
    try:
        stack.start()
        report.serve_ready_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        _send_all(stack.url, stack.model_name, sets, sizes.max_tokens)
        report.requests_s = time.perf_counter() - t1
    finally:
        stack.stop()
        report.server_log_tail = stack.log()[-4000:]
    model = ref_future.result()
    t2 = time.perf_counter()
    try:
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        _wait_for_device_memory(device, 2 * nbytes)
        model.to(device)
        for c in (c for s in sets for c in s):
            report.requests += 1
            for p in reference_problems(model, c, sizes.max_tokens, tol, report):
                report.problems.append(f"{len(c.prompt)}-token prompt: {p}")
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.reference_s = time.perf_counter() - t2
    return report


class Results:
    """Every case's outcome in one JSON file (None: kept in memory only), written again after
    each case: the environment (device, date, commit), then per case its shape's config, the
    tolerance, whether it passed, its Report (the first 50 problems) or the error it raised."""

    def __init__(self, path: Path | None, device: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "benchmark": "real_shapes",
            "env": common.env_info(device),
            "cases": {},
        }

    @contextlib.contextmanager
    def case(self, shape: str, fmt: str, tol: float):
        """Yields record(report); an exception inside is recorded, then raised again."""
        entry: dict[str, Any] = {"shape": shape, "format": fmt, "tolerance": tol}
        entry["config"] = SHAPES[shape].config

        def record(report: Report) -> None:
            d = asdict(report)
            d["num_problems"] = len(report.problems)
            d["problems"] = report.problems[:50]
            if not report.problems:
                d.pop("server_log_tail")
            entry.update(d)

        t0 = time.perf_counter()
        try:
            yield record
        except BaseException as e:
            entry["error"] = f"{type(e).__name__}: {e}"[-6000:]
            raise
        finally:
            entry["wall_s"] = time.perf_counter() - t0
            entry["passed"] = "error" not in entry and entry.get("num_problems") == 0
            self.data["cases"][f"{shape}-{fmt}"] = entry
            if self.path is not None:
                common.write_json(self.path, self.data)
