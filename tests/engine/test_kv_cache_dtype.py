"""--kv-cache-dtype on the CPU executor: greedy tokens and logprobs of the paged forward against
transformers whose attention sees K (after rotary) and V rounded the same way, written here
from torch's own float8 casts (teacher-forced: tests/greedy_reference.py); checkpoint k_scale /
v_scale; the flag's refusals; KV sizing."""

from __future__ import annotations

import argparse
import itertools
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from voltserve.services.executor.engine_args import add_engine_flags, engine_config
from voltserve.services.executor.kv_quant import check_supported
from voltserve.services.executor.kv_sizing import (
    decide_num_blocks,
    kv_bytes_per_block,
    workspace_bytes_per_block,
)
from voltserve.services.executor.model_runner import ModelRunner
from voltserve.services.executor.request import Request
from voltserve.shared.config import EngineConfig
from voltserve.shared.sampling_params import SamplingParams
from voltserve.shared.startup import StartupError

from tests.checkpoints import checkpoint, drive, hf_model_class, tokenizer
from tests.greedy_reference import check_greedy_against, reference_logprobs
from tests.kv_rounding import codes, from_codes, rounded

LOGPROB_ATOL = 1e-4
# The engine's K and V differ from transformers' in the last fp32 bits (another summation
# order), so an element within that distance of a rounding midpoint of the one-byte format may
# take the neighbouring code, and one code step of a large element moves a logprob by far more
# than LOGPROB_ATOL. Where the engine's cache is at hand (check_against), such an element (its
# code changes under a relative nudge of NUDGE) takes the engine's code when that is one of its
# two candidates; everything else is rounded by the reference alone. Elsewhere (a served
# engine) a prompt whose reference K / V hold such an element is checked at AMBIGUOUS_ATOL.
NUDGE = 1e-6
AMBIGUOUS_ATOL = 1e-2


def rounded_reference(
    path, kv_dtype: str | None, scales=None, nudge: float = NUDGE, causal: bool = False
):
    """transformers (fp32, CPU) with every attention call's K and V rounded to kv_dtype (None:
    as is), each layer's (k_scale, v_scale) from `scales` (default 1.0); model.ambiguous says
    whether an element sat within a relative `nudge` of a rounding midpoint and was not
    resolved by model.cached ({layer index: (K codes, V codes)}, each [kv heads, positions,
    head dim] as the engine stored them; see resolved). causal: torch's SDPA in its own causal
    form on K and V repeated to every query head (one unpadded sequence only): fp32 with
    grouped KV heads would take the math kernel, whose [heads, T, T] scores are 64 GiB at 32K
    tokens; the memory-efficient kernel never holds them."""
    name = f"voltserve_kv_{next(_NAMES)}"  # looked up at each call: one name per model
    scales = scales or {}

    def attention(module, query, key, value, attention_mask, **kw):
        if kv_dtype is not None:
            ks, vs = scales.get(module.layer_idx, (1.0, 1.0))
            if kv_dtype == "fp16":
                key, value = rounded(key, kv_dtype, ks), rounded(value, kv_dtype, vs)
            else:
                kc, vc = (model.cached or {}).get(module.layer_idx, (None, None))
                key, k_open = resolved(key, kv_dtype, ks, nudge, kc)
                value, v_open = resolved(value, kv_dtype, vs, nudge, vc)
                model.ambiguous |= k_open or v_open
        if causal:
            groups = query.shape[1] // key.shape[1]
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, is_causal=True, scale=kw.get("scaling")
            )
            return out.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(name, attention)
    model = hf_model_class(path).from_pretrained(
        path, dtype=torch.float32, attn_implementation=name
    )
    model.ambiguous = False
    model.cached = None
    return model


def resolved(
    x: torch.Tensor, kv_dtype: str, scale: float, nudge: float, cached: torch.Tensor | None
) -> tuple[torch.Tensor, bool]:
    """x [1, heads, T, D] rounded to kv_dtype, and whether an element within a relative `nudge`
    of a rounding midpoint was left to the reference's own rounding. With `cached` (the
    engine's codes of the first t positions: the last fed token's K / V only reach logits
    nobody checks) such an element takes the engine's code when that is one of its two
    candidate codes; every other element keeps the reference's, so a wrong rounding still
    shows."""
    c = codes(x, kv_dtype, scale)
    up, down = codes(x * (1 + nudge), kv_dtype, scale), codes(x * (1 - nudge), kv_dtype, scale)
    near = (up != c) | (down != c)
    if cached is None:
        return from_codes(c, kv_dtype, scale, x.dtype), bool(near.any())
    t = cached.shape[-2]
    e = cached.to(x.device)[None]
    head = (slice(None), slice(None), slice(0, t))
    take = near[head] & ((e == c[head]) | (e == up[head]) | (e == down[head]))
    c[head] = torch.where(take, e, c[head])
    open_ = near[head] & ~take
    return from_codes(c, kv_dtype, scale, x.dtype), bool(open_.any())


def engine_codes(runner, req, n_tokens: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer index: (K codes, V codes)} of req's first n_tokens positions in runner's cache,
    each [kv heads, n_tokens, head dim]; the full-attention layers only on a hybrid model."""
    kinds = getattr(runner.arch, "layer_types", ()) or ("full_attention",) * runner.arch.num_layers
    layers = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    assert len(layers) == len(runner.kv_caches), (kinds, len(runner.kv_caches))
    bs = runner.block_size
    blocks = torch.tensor(req.block_ids[: -(-n_tokens // bs)])

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # [blocks, heads, block size, D] -> [heads, positions, D]
        g = cache[blocks].permute(1, 0, 2, 3)
        return g.reshape(g.shape[0], -1, g.shape[-1])[:, :n_tokens].cpu()

    return {i: (gather(k), gather(v)) for i, (k, v) in zip(layers, runner.kv_caches, strict=True)}


_NAMES = itertools.count()


def run_prompts(runner, prompts, max_new: int, chunk: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=3, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params, seed=i, arrival_time=0.0) for i, p in enumerate(prompts)]
    drive(runner, reqs, max_new, chunk=chunk)
    return reqs


def check_against(
    runner, reqs, prompts, path, kv_dtype, max_new, scales=None, nudge=NUDGE, atol=LOGPROB_ATOL
) -> float:
    """Asserts tokens and logprobs at `atol` against the rounded reference, teacher-forced
    on each request's tokens (greedy_reference.check_greedy), its midpoint elements resolved by
    runner's cache (rounded_reference); returns the largest logprob gap between the rounded and
    the unrounded reference over them (how much the rounding moved them)."""
    model = rounded_reference(path, kv_dtype, scales, nudge)
    plain = rounded_reference(path, None)
    moved = 0.0
    for r, prompt in zip(reqs, prompts, strict=True):
        served = [tok.token_id for tok in r.trace]
        assert r.output_token_ids == served and len(served) == max_new, kv_dtype
        model.ambiguous = False
        if kv_dtype != "fp16":
            model.cached = engine_codes(runner, r, len(prompt) + max_new - 1)
        lp = reference_logprobs(model, prompt, served)
        model.cached = None
        assert not model.ambiguous, "a midpoint element the engine's cache did not resolve"
        check_greedy_against(lp, prompt, served, [t.logprob for t in r.trace], atol)
        for step, tok in enumerate(r.trace):
            got_v = torch.tensor([v for _, v in tok.top_logprobs])
            assert torch.allclose(got_v, lp[step].topk(3).values, atol=atol, rtol=0)
        moved = max(moved, (reference_logprobs(plain, prompt, served) - lp).abs().max().item())
    return moved


@pytest.mark.parametrize(
    ("arch", "kv_dtype"), [("qwen3", "fp8_e5m2"), ("llama", "fp8_e4m3"), ("qwen2", "fp16")]
)
def test_rounded_kv_matches_transformers(arch: str, kv_dtype: str, rng) -> None:
    """Chunked prefill, mixed and decode-only steps over a cache that stores one byte (or an
    fp16 value under the fp32 run) per element."""
    path = checkpoint(arch)
    runner = ModelRunner(EngineConfig(model=str(path), num_kv_blocks=32, kv_cache_dtype=kv_dtype))
    want_dtype = torch.float16 if kv_dtype == "fp16" else torch.uint8
    assert all(k.dtype == v.dtype == want_dtype for k, v in runner.kv_caches)
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (rng.randint(2, 6), 37)]
    max_new = 6
    reqs = run_prompts(runner, prompts, max_new, chunk=rng.choice([7, 16, 29]))
    moved = check_against(runner, reqs, prompts, path, kv_dtype, max_new)
    # The reference's rounding is visible at this tolerance: the test tells formats apart.
    if kv_dtype != "fp16":
        assert moved > 10 * LOGPROB_ATOL


def test_checkpoint_kv_scales(tmp_path, rng, caplog) -> None:
    """k_scale / v_scale tensors in the checkpoint (compressed-tensors names on layer 0,
    ModelOpt names on layer 1) divide on the write and multiply on the read; layers without
    them take 1.0, and the log says where the scales came from."""
    path = shutil.copytree(checkpoint("qwen3"), tmp_path / "qwen3")
    scales = {0: (0.375, 2.75), 1: (3.125, 0.21875)}  # exact in fp32, not powers of two
    one = lambda x: torch.tensor([x], dtype=torch.float32)  # noqa: E731
    save_file(
        {
            "model.layers.0.self_attn.k_scale": one(scales[0][0]),
            "model.layers.0.self_attn.v_scale": one(scales[0][1]),
            "model.layers.1.self_attn.k_proj.k_scale": one(scales[1][0]),
            "model.layers.1.self_attn.v_proj.v_scale": one(scales[1][1]),
        },
        str(path / "kv_scales.safetensors"),
    )
    with caplog.at_level("INFO", logger="voltserve.services.executor.kv_quant"):
        runner = ModelRunner(EngineConfig(model=str(path), num_kv_blocks=32, kv_cache_dtype="fp8"))
    assert "k_scale / v_scale (2 of" in caplog.text
    layers = runner.model.model.layers
    for i, layer in enumerate(layers):
        q = layer.self_attn.kv_quant
        assert (q.fmt, q.k_scale, q.v_scale) == ("fp8_e4m3", *scales.get(i, (1.0, 1.0)))
    V = len(tokenizer())
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 29)]
    reqs = run_prompts(runner, prompts, 5, chunk=16)
    check_against(runner, reqs, prompts, path, "fp8", 5, scales)


def test_unknown_kv_cache_dtype_refused(capsys) -> None:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--kv-cache-dtype", "fp4"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    args = p.parse_args(["--model", "m", "--kv-cache-dtype", "fp8_e5m2"])
    assert engine_config(args).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_config(model="m", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="m", kv_cache_dtype="e4m3")


def test_cuda_needs_the_float16_run_dtype() -> None:
    """On CUDA any KV storage but the run dtype's is refused at start-up with another run dtype,
    naming it: the attention kernels (and the one-byte formats' write and widening) take
    float16 only. The one-byte formats are not refused otherwise (hybrid models, speculation
    and tensor parallelism: test_kv_fp8_paths.py)."""
    cuda = torch.device("cuda")
    for kv in ("fp16", "fp8"):
        cfg = EngineConfig(model="m", kv_cache_dtype=kv, dtype="bfloat16")
        with pytest.raises(StartupError, match="float16 run dtype"):
            check_supported(cfg, torch.bfloat16, cuda)
    check_supported(EngineConfig(model="m", kv_cache_dtype="fp8_e5m2"), torch.float16, cuda)
    check_supported(EngineConfig(model="m", dtype="bfloat16"), torch.bfloat16, cuda)


def test_fp8_blocks_are_half_the_bytes() -> None:
    """A byte budget holds twice the blocks' worth of layers in one-byte storage as in fp16
    (four times the fp32 run dtype's), less one layer's K and V in the run dtype per block: the
    workspace the pages are widened into, allocated with the caches and counted by the
    sizing."""
    budget = 1 << 20
    blocks, per_block = {}, {}
    for d in ("auto", "fp16", "fp8"):
        cfg = EngineConfig(
            model=str(checkpoint("llama")), kv_cache_dtype=d, cpu_kv_cache_bytes=budget
        )
        runner = ModelRunner(cfg)
        blocks[d], per_block[d] = decide_num_blocks(runner), kv_bytes_per_block(runner)
        assert runner.num_kv_blocks == blocks[d]
        got = sum(t.numel() * t.element_size() for kv in runner.kv_caches for t in kv)
        ws = runner.kv_workspace
        if d == "fp8":
            # One layer's K and V (fp32 here) per block, and every cache's storage one byte.
            k = runner.kv_caches[0][0]
            assert ws.nbytes == 2 * k.numel() * 4 == blocks[d] * workspace_bytes_per_block(runner)
            assert all(a.self_attn.kv_quant.workspace is ws for a in runner.model.model.layers)
            got += ws.nbytes
        else:
            assert ws is None and workspace_bytes_per_block(runner) == 0
        assert got == blocks[d] * per_block[d]
    layers = len(runner.kv_caches)
    ws_per_block = workspace_bytes_per_block(runner)
    assert per_block["auto"] == 2 * per_block["fp16"] == 4 * (per_block["fp8"] - ws_per_block)
    assert ws_per_block * layers == per_block["auto"]  # one layer of the fp32 run dtype
    assert blocks["fp8"] == budget // per_block["fp8"]
