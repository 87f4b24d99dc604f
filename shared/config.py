"""Plain configuration dataclasses. One per concern; services build them from CLI flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from voltserve.services.executor.spec.config import SpeculativeConfig


# --kv-cache-dtype, vLLM's names: "auto" stores the KV cache in the run dtype, "fp16" in
# float16 whatever the run dtype, "fp8" (= "fp8_e4m3") and "fp8_e5m2" in one byte per element
# (services/executor/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "fp16", "fp8", "fp8_e5m2", "fp8_e4m3")
# The weight formats --quantization names (services/executor/quant/detect.py reads each).
QUANTIZATION_METHODS = ("awq", "gptq", "compressed-tensors", "modelopt", "gguf")


@dataclass
class EngineConfig:
    model: str
    # "auto": fp16 on CUDA (SM70 has no bf16; bf16 checkpoints are converted), fp32 on CPU.
    dtype: str = "auto"
    # "auto": cuda when available, else cpu.
    device: str = "auto"
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    # Fixed number of KV blocks (tests use this to force preemption). None: sized from memory.
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # CPU: KV cache bytes when num_kv_blocks is None.
    cpu_kv_cache_bytes: int = 256 * 1024 * 1024
    # None: on, except for models with linear-attention state (off for them); True for such a
    # model is refused.
    enable_prefix_caching: bool | None = None
    # Decode steps run as CUDA graphs unless this is set.
    enforce_eager: bool = False
    # Largest decode batch captured as a CUDA graph; larger batches run eagerly.
    max_graph_batch_size: int = 256
    # The decode batch sizes to capture (each <= max_graph_batch_size; a batch runs the
    # smallest captured size that holds it). Empty: 1, 2, 4, 8, then every 8 up to
    # max_graph_batch_size. Fewer sizes start faster (each capture takes ~1-3 s on a GPU).
    cuda_graph_sizes: tuple[int, ...] = ()
    # Ranks of one tensor-parallel group (one process and one GPU each); rank 0 runs the engine.
    tensor_parallel_size: int = 1
    # Seeds the engine's choice of per-request seeds for requests that give none.
    seed: int = 0
    # --speculative-config (vLLM's keys), parsed and validated once by the config's builder
    # (services/executor/engine_args.engine_config). None: no speculation.
    speculative_config: SpeculativeConfig | None = None
    # Force a quantization method (awq, gptq, compressed-tensors, modelopt, gguf); None: from the
    # checkpoint. A forced method the checkpoint does not use is an error.
    quantization: str | None = None
    # GPU memory budget in bytes (None: the whole card): KV sizing uses min(card, budget), so a
    # 16 or 32 GB V100 can be simulated on a bigger card.
    max_gpu_memory: int | None = None
    # The KV cache's storage: one of KV_CACHE_DTYPES.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            # Refused here rather than failing at the first step that reads it.
            raise TypeError(
                "speculative_config must be a SpeculativeConfig; its JSON object is parsed by "
                "services/executor/engine_args.engine_config(speculative_config={...})"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
