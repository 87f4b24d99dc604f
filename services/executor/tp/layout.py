"""Which heads, KV heads, MLP columns (each expert's too), linear-attention heads and vocabulary
rows one rank holds (Megatron-style), and the checks that refuse a tensor-parallel size the
model cannot be split by."""

from __future__ import annotations

from dataclasses import dataclass

from voltserve.services.executor.tp.sharding import TPSplitError, split_range


@dataclass(frozen=True)
class TPLayout:
    rank: int
    size: int
    num_heads: int  # this rank's query heads
    head_start: int
    num_kv_heads: int  # this rank's KV heads (1 each when replicated)
    kv_head_start: int
    inter_start: int
    inter_size: int
    vocab_start: int
    vocab_per_rank: int  # the padded vocabulary's share: vocab_per_rank * size >= vocab
    # MoE: this rank's columns of every expert's intermediate dim, and of the shared expert's
    moe_inter_start: int = 0
    moe_inter_size: int = 0
    shared_inter_start: int = 0
    shared_inter_size: int = 0
    # Gated DeltaNet (hybrid models): this rank's key heads and value heads (value head h
    # reads key head h // (Hv / Hk), so a rank's value heads read its own key heads only)
    lin_key_start: int = 0
    lin_key_heads: int = 0
    lin_value_start: int = 0
    lin_value_heads: int = 0

    @staticmethod
    def build(arch, rank: int = 0, size: int = 1) -> TPLayout:
        """arch: a ModelArch. Raises TPSplitError for a size the model cannot be split by."""
        if size < 1:
            raise TPSplitError(f"tensor-parallel size must be >= 1, got {size}")
        if size > arch.num_heads:
            raise TPSplitError(
                f"tensor-parallel size {size} is larger than the model's {arch.num_heads} "
                "attention heads"
            )
        h0, h = split_range(arch.num_heads, rank, size, "num_attention_heads")
        kv = arch.num_kv_heads
        if kv >= size:
            k0, k = split_range(kv, rank, size, "num_key_value_heads")
        else:
            # Fewer KV heads than ranks: each rank keeps the one KV head its query heads use.
            if size % kv:
                raise TPSplitError(
                    f"num_key_value_heads = {kv} is fewer than tensor-parallel size {size} and "
                    "does not divide it, so KV heads cannot be replicated evenly"
                )
            k0, k = rank * kv // size, 1
        i0, i = split_range(arch.intermediate_size, rank, size, "intermediate_size")
        vp = -(-arch.vocab_size // size)
        m0 = m = s0 = sh = 0
        if arch.num_experts:
            m0, m = split_range(arch.moe_intermediate_size, rank, size, "moe_intermediate_size")
        if arch.shared_expert_intermediate_size:
            s0, sh = split_range(
                arch.shared_expert_intermediate_size,
                rank,
                size,
                "shared_expert_intermediate_size",
            )
        lk0 = lk = lv0 = lv = 0
        if getattr(arch, "linear_num_key_heads", 0):
            lk0, lk = split_range(arch.linear_num_key_heads, rank, size, "linear_num_key_heads")
            lv0, lv = split_range(arch.linear_num_value_heads, rank, size, "linear_num_value_heads")
        return TPLayout(
            rank, size, h, h0, k, k0, i0, i, rank * vp, vp, m0, m, s0, sh, lk0, lk, lv0, lv
        )
