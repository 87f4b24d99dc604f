"""Paged attention (decode, prefill, flash prefill, the reference) and what feeds it: rotary, the
KV-cache write, and the fused q/k-norm + rotary + cache write."""

from voltserve.kernels.registry import KernelSpec, Op, both

OPS = (
    Op(
        "rotary_embedding",
        "attention.rotary.rotary_embedding_ref",
        ("attention.rotary",),
        capturable_ref=True,
        decode_graph=True,
    ),
    Op(
        "reshape_and_cache",
        "attention.kv_cache.reshape_and_cache_ref",
        ("attention.kv_cache",),
        decode_graph=True,
    ),
    # rotary_embedding then reshape_and_cache in one launch (what the models call).
    Op(
        "rotary_and_cache",
        "attention.rotary_cache.rotary_and_cache_ref",
        ("attention.rotary_cache",),
        decode_graph=True,
    ),
    # Per-head q/k RMSNorm, then rotary_and_cache, in one launch (q/k-norm models: Qwen3). Not in
    # the decode graph's list: the model calls it only where it is the kernel (capturable) or
    # where rms_norm and rotary_and_cache are of its own kind (qk_norm_rope.covers), so those two
    # decide; with VOLTSERVE_QK_NORM_ROPE=0 (the separate kernels) it is a reference the model
    # never calls.
    Op(
        "qk_norm_rope_and_cache",
        "attention.qk_norm_rope.qk_norm_rope_and_cache_ref",
        ("attention.qk_norm_rope",),
        env="VOLTSERVE_QK_NORM_ROPE",
    ),
    # prefill_fa.paged_attention_cuda: the flash kernel where it covers the shape (head dims 64,
    # 128 and 256), the CUDA-core kernel of prefill.py otherwise. The attention kernels are written
    # for 16-token KV blocks.
    Op(
        "paged_attention",
        "attention.ref.paged_attention_ref",
        ("attention.prefill_fa", "attention.prefill", "attention.ref"),
        cuda_dtypes=("float16",),
        block_sizes=(16,),
    ),
    Op(
        "paged_decode_attention",
        "attention.ref.paged_decode_attention_ref",
        ("attention.decode", "attention.ref"),
        cuda_dtypes=("float16",),
        block_sizes=(16,),
        decode_graph=True,
    ),
    # The one-byte (fp8) KV cache (services/executor/kv_quant.py): the quantizing cache write,
    # and the widening of the pages a step reads into an fp16 workspace of the cache's shape,
    # which the fp16 attention kernels above then read. Both launchers take fp16 K/V and never
    # sync with the host (a decode graph holds them: kv_quant.GRAPH_OPS); the references do.
    Op(
        "reshape_and_cache_fp8",
        "attention.kv_cache_fp8.reshape_and_cache_fp8_ref",
        ("attention.kv_cache_fp8",),
        cuda_dtypes=("float16",),
    ),
    Op(
        "expand_kv_pages",
        "attention.kv_expand.expand_kv_pages_ref",
        ("attention.kv_expand",),
        cuda_dtypes=("float16",),
    ),
    # Decode-only steps read the one-byte pages directly (converted per tile in registers):
    # half the bytes of the widened pages, and no expansion pass.
    Op(
        "paged_decode_attention_fp8",
        "attention.decode_fp8.paged_decode_attention_fp8_ref",
        ("attention.decode_fp8",),
        cuda_dtypes=("float16",),
        block_sizes=(16,),
    ),
)

KERNELS = (
    # rotary.py
    KernelSpec(
        "attention.rotary",
        "rotary_embedding_kernel",
        both("void(int64[::1], {t}[:, :], {t}[:, :], int64, float32[:, ::1], boolean, boolean)"),
    ),
    # kv_cache.py
    KernelSpec(
        "attention.kv_cache",
        "reshape_and_cache_kernel",
        both(
            "void({t}[:, :, :], {t}[:, :, :], {t}[:, :, :, ::1], {t}[:, :, :, ::1], int64[::1],"
            " boolean)"
        ),
    ),
    # rotary_cache.py: rotary + KV-cache write in one launch. Arguments: positions, q and k rows
    # (strided views of the fused qkv), head_dim, cos/sin cache, is_neox, vec_rot, k and v as
    # [T, kv_heads, head_dim] views, the k/v caches, slot_mapping, vec_cache. head_dim is a
    # runtime argument, so one signature per dtype serves head_dim 128 and 64 alike.
    KernelSpec(
        "attention.rotary_cache",
        "rotary_and_cache_kernel",
        both(
            "void(int64[::1], {t}[:, :], {t}[:, :], int64, float32[:, ::1], boolean, boolean,"
            " {t}[:, :, :], {t}[:, :, :], {t}[:, :, :, ::1], {t}[:, :, :, ::1], int64[::1],"
            " boolean)"
        ),
    ),
    # qk_norm_rope.py: per-head q/k RMSNorm + rotary + KV-cache write, one warp per (token,
    # head). Arguments: positions, q/k/v rows (strided views of the fused qkv), the q and k norm
    # weights, eps, head_dim, cos/sin cache, the k/v caches, slot_mapping.
    KernelSpec(
        "attention.qk_norm_rope",
        "qk_norm_rope_kernel",
        both(
            "void(int64[::1], {t}[:, :], {t}[:, :], {t}[:, :], {t}[::1], {t}[::1], float32,"
            " int64, float32[:, ::1], {t}[:, :, :, ::1], {t}[:, :, :, ::1], int64[::1])"
        ),
    ),
)

# kv_cache_fp8.py / kv_expand.py: the one-byte KV cache's write (fp16 K/V in, uint8 codes out;
# e4m3 flag, k/v scales) and the widening of a step's pages into an fp16 workspace of the
# cache's shape (the format's 256-entry decoding table, k/v scales), which the fp16 attention
# kernels below then read. fp16 only: the CUDA attention kernels take fp16.
KERNELS += (
    KernelSpec(
        "attention.kv_cache_fp8",
        "reshape_and_cache_fp8_kernel",
        (
            "void(float16[:, :, :], float16[:, :, :], uint8[:, :, :, ::1], uint8[:, :, :, ::1],"
            " int64[::1], boolean, float32, float32)",
        ),
    ),
    KernelSpec(
        "attention.kv_expand",
        "expand_kv_pages_kernel",
        (
            "void(uint8[:, :, :, ::1], uint8[:, :, :, ::1], float16[:, :, :, ::1],"
            " float16[:, :, :, ::1], int32[:, ::1], int32[::1], float32[::1], float32, float32)",
        ),
    ),
)

# decode.py: the kernels are built per shape by decode_kernel(); the module exposes a few
# representative instances. Arguments: out, q, flat k/v caches, block_tables, seq_lens, scale,
# num_kv_heads, max_logits, exp_sums, tmp_out, merge counters.
_DECODE_SIG = (
    "void(float16[:, :, ::1], float16[:, :, ::1], float16[::1], float16[::1], int32[:, ::1],"
    " int32[::1], float64, int64, float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1],"
    " int32[::1])"
)
KERNELS += tuple(
    KernelSpec("attention.decode", name, (_DECODE_SIG,))
    for name in (
        "decode_kernel_d128_g4",
        "decode_kernel_d128_g4_direct",
        "decode_kernel_d128_g4_spread",
        "decode_kernel_d128_g4_merge",
        "decode_kernel_d128_g4_online",
        "decode_kernel_d256_g1_online",
    )
)
KERNELS += (
    KernelSpec(
        "attention.decode",
        "decode_reduce_kernel",
        (
            "void(float16[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1],"
            " float32[:, :, :, ::1], int32[::1], int64, int64, int64)",
        ),
    ),
)

# decode_fp8.py: decode.py's kernels over a one-byte cache (flat uint8 k/v caches), the V side's
# factor as one more argument; the merge kernel is decode.py's.
_DECODE_FP8_SIG = (
    "void(float16[:, :, ::1], float16[:, :, ::1], uint8[::1], uint8[::1], int32[:, ::1],"
    " int32[::1], float64, int64, float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1],"
    " int32[::1], float64)"
)
KERNELS += tuple(
    KernelSpec("attention.decode_fp8", name, (_DECODE_FP8_SIG,))
    for name in (
        "decode_fp8_kernel_d128_g4_e4m3",
        "decode_fp8_kernel_d128_g4_e5m2_online",
    )
)

# prefill.py: per-shape kernels from prefill_kernel(); representative instances. Arguments: out,
# q, flat k/v caches, block_tables, seq_lens, query_start_loc, scale, num_kv_heads.
_PREFILL_SIG = (
    "void(float16[:, :, ::1], float16[:, :, ::1], float16[::1], float16[::1], int32[:, ::1],"
    " int32[::1], int32[::1], float64, int64)"
)
KERNELS += tuple(
    KernelSpec("attention.prefill", name, (_PREFILL_SIG,))
    for name in ("prefill_kernel_d128_g4", "prefill_kernel_d64_g7", "prefill_kernel_d256_g1")
)

# prefill_fa.py: the flash prefill (the whole key loop in linked prefill_fa.cu, what the engine
# runs for head dims 64, 128 and 256), one kernel per head dim. Arguments: flat out, flat q,
# flat k/v caches, block_tables, seq_lens, query_start_loc, scale, num_kv_heads, group (query
# heads per KV head). check-kernels links without LTO, so the C function is an ABI call there (see the
# module).
_PREFILL_FA_SIG = (
    "void(float16[::1], float16[::1], float16[::1], float16[::1], int32[:, ::1], int32[::1],"
    " int32[::1], float64, int64, int64)"
)
KERNELS += tuple(
    KernelSpec("attention.prefill_fa", name, (_PREFILL_FA_SIG,))
    for name in ("prefill_fa_kernel_d128", "prefill_fa_kernel_d64", "prefill_fa_kernel_d256")
)
