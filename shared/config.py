"""Configuration structs, validated by msgspec so an error names the offending key."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything the executor engine needs; the `model` and `kv_cache` keys of jetserve.yaml."""

    model: str = DEFAULT_MODEL  # a name, a GGUF path, an HF directory, or dummy:<shape>
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attention_backend: Literal["auto", "torch"] = "auto"  # "triton" joins with kernels/
    max_model_len: Annotated[int, msgspec.Meta(ge=16)] | None = None
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 128
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=16)] = 512
    block_size: Annotated[int, msgspec.Meta(ge=1)] = 16
    # KV pool: an explicit block count wins; else a share of free GPU memory, or a size on CPU.
    num_kv_blocks: Annotated[int, msgspec.Meta(ge=2)] | None = None
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    cpu_kv_cache_gib: Annotated[float, msgspec.Meta(gt=0)] = 4.0
    enable_prefix_caching: bool = True
    # Overlap CPU work of step N+1 and N with model execution of step N.
    pipeline: bool = True
    num_threads: Annotated[int, msgspec.Meta(ge=1)] | None = None  # torch intra-op threads on CPU
    weights_cache_dir: str | None = None  # where a converted GGUF is cached as safetensors
    executor_name: str = "executor-0"
