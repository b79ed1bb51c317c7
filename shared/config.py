"""Configuration structs, validated by msgspec so an error names the offending key."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
Quantization = Literal["none", "int8", "int4", "auto"]


class TlsSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """TLS to the NATS server: `ca` verifies the server's certificate (the system's CAs
    without it); `cert` and `key` are this connection's own, for a server that asks for one."""
    ca: str | None = None
    cert: str | None = None
    key: str | None = None


class NatsSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: str = "nats://127.0.0.1:4222"  # may hold user:password@; a comma-separated list too
    # Credentials, one kind at most (or in the URL). Secrets come best from the environment
    # (JETSERVE_NATS__PASSWORD, JETSERVE_NATS__TOKEN) or a file; none is ever logged.
    user: str | None = None
    password: str | None = None
    password_file: str | None = None  # the password from a file (a mounted secret) instead
    token: str | None = None
    nkey_seed: str | None = None  # a file holding an nkey seed (needs PyPI `nkeys`)
    creds: str | None = None  # a .creds file: a user JWT and its seed (needs PyPI `nkeys`)
    tls: TlsSection | None = None
    prefix: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")] = "llm"
    # Clients' answers go only to reply subjects under this prefix (docs/protocol.md): the inbox
    # prefix of the NATS client libraries, unless clients are configured with another.
    client_inbox_prefix: Annotated[str, msgspec.Meta(
        pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")] = "_INBOX"
    # A tenant's answers go only under `<client_inbox_prefix>.<tenant>.`, where the permissions
    # of `jetserve up --auth` let that tenant alone subscribe: no tenant can aim its answers
    # at another's inbox. On under `--auth` and in compose.yaml; off, any client inbox.
    tenant_inboxes: bool = False
    # JetStream replicas of jetserve's streams (admission's consumer follows its stream): None
    # leaves them as they are (new streams: the server's default, 1); 3 on a cluster of three
    # or more nodes, so losing one loses nothing (applied to existing streams at start).
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] | None = None
    results_max_age_s: Annotated[float, msgspec.Meta(gt=0.0)] = 24 * 3600.0
    # A held durable request is kept alive with in-progress acks well inside this window.
    ack_wait_s: Annotated[float, msgspec.Meta(ge=1.0)] = 30.0
    duplicate_window_s: Annotated[float, msgspec.Meta(gt=0.0)] = 120.0
    # Durable requests admission may hold at once (the LLM_REQUESTS consumer's max_ack_pending;
    # the server's default, 1,000, would cap durable work in flight whatever the executors).
    max_ack_pending: Annotated[int, msgspec.Meta(ge=1)] = 50_000
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 5.0  # internal request/reply hops
    # At start, how long a service waits for the server to answer before it exits with an error
    # (once connected, it reconnects for as long as it takes).
    connect_wait_s: Annotated[float, msgspec.Meta(gt=0.0)] = 30.0


class ModelSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = DEFAULT_MODEL  # a name, a GGUF path, an HF directory, dummy:<shape>, sim:<profile>
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: bf16 on a GPU, and on a CPU with native bf16 (AVX512-BF16) with `quantization: none`;
    # else fp32 (docs/operations.md, `model.dtype`).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Weight-only quantization of the matmuls on a CPU (services/executor/engine/linear.py):
    # none, int8, int4, or auto (a GGUF's own blocks: Q4_x stays int4, Q8_0 int8; none otherwise).
    quantization: Quantization = "none"
    # How quantized matmuls take their activations: float32 (weight-only quantization: the
    # weights widened to fp32), int8 (each row quantized to 8 bits per group of 32 as it enters,
    # int8 dot products: W8A8 / W4A8; needs AVX512-VNNI), or auto: int8 where the CPU has VNNI,
    # else float32.
    quantized_activations: Literal["auto", "float32", "int8"] = "float32"
    # AMX on a CPU that has it, for the CPU kernels' matmuls (docs/operations.md, Precision):
    # auto: quantized weights' prefills through torch's matmul (from 49 rows); a bf16 model stays
    # on AVX-512 (the kernels' own tiles have not yet been measured on an AMX CPU). tiles: a bf16
    # model's matmuls on the kernels' own AMX-BF16 tiles too, at every row count, and int8
    # activations' (W8A8 / W4A8) on AMX-INT8 tiles from 16 rows, with the VNNI kernel's bits,
    # instead of torch's bf16 matmul. none: no AMX.
    amx: Literal["auto", "tiles", "none"] = "auto"
    # A CPU engine's packed weights in transparent huge pages, where the host's THP mode is
    # madvise or always (services/executor/engine/huge_pages.py; off: torch's 4 KiB pages); the
    # KV cache's: kv_cache.huge_pages.
    huge_pages: bool = True
    # auto: triton on CUDA, torch on a CPU (triton on a CPU needs TRITON_INTERPRET=1: tests only)
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    max_model_len: Annotated[int, msgspec.Meta(ge=16)] | None = None
    weights_cache_dir: str | None = None  # where a converted GGUF is cached as safetensors
    # A directory of tokenizer files (tokenizer.json, tokenizer_config.json) to use instead of
    # the model's own, as vLLM's --tokenizer; dummy and sim models otherwise use the default
    # model's.
    tokenizer: str | None = None
    num_threads: Annotated[int, msgspec.Meta(ge=1)] | None = None  # torch intra-op threads on CPU
    # On a CPU: one torch thread fewer for each core other processes keep busy, down to one
    # (services/executor/engine/cpu_share.py); num_threads (or torch's default) is the most.
    adaptive_threads: bool = True


class KvCacheSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    block_size: Annotated[int, msgspec.Meta(ge=1)] = 16
    # The pool: an explicit block count wins; else a share of free GPU memory, or a size on a
    # CPU. With two pools the count is the memory of that many blocks of the model's dtype.
    num_blocks: Annotated[int, msgspec.Meta(ge=2)] | None = None
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    cpu_cache_gib: Annotated[float, msgspec.Meta(gt=0.0)] = 4.0
    enable_prefix_caching: bool = True
    # A CPU engine's KV cache in transparent huge pages too (huge_pages.py; model.huge_pages is
    # the weights'). Off: on SmolLM2 it gained nothing measurable (single stream, a 4,096-token
    # context, 64 and 128 requests), and where a VM hands free memory back to its host, faulting
    # in the default 4 GiB as 2 MiB pages added ~4 s to every start (BENCHMARKS, "huge pages").
    huge_pages: bool = False
    # auto: the model's dtype; int8: each (token, head) row as int8 codes with an fp16 scale and
    # offset per 32 (jetserve_kernels/kv_int8.py), ~3.56x the tokens of fp32 in the same memory;
    # bfloat16: bf16 rows under an fp32 model (the CPU kernels widen them as they read), 2x.
    dtype: Literal["auto", "int8", "bfloat16"] = "auto"
    # Requests of a priority under this keep their KV in int8 blocks of a second pool, which
    # takes `compressed_fraction` of the KV memory; the rest stays in `dtype` (None: one pool).
    compress_below_priority: Annotated[int, msgspec.Meta(ge=1, le=10)] | None = None
    compressed_fraction: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.5

    def __post_init__(self):
        if self.compress_below_priority is not None and self.dtype == "int8":
            raise ValueError("`compress_below_priority` needs `dtype: auto`: with `dtype: int8` "
                             "every block is int8 already")


Positive = Annotated[float, msgspec.Meta(gt=0.0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0.0)]


class RequestLevel(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Admission and the global queue: its order (docs/scheduling.md) and its limits."""

    max_pending_requests: Annotated[int, msgspec.Meta(ge=1)] = 10_000
    # fcfs: arrival order. priority: base priority, then arrival. adaptive: the score below.
    policy: Literal["fcfs", "priority", "adaptive"] = "adaptive"
    # The score, in units of one priority level when base_weight is priority_levels - 1:
    # base_weight * class_weight * priority / (priority_levels - 1)
    # + urgency_weight * urgency * load_adjustment + resource_weight * resource + fairness.
    priority_levels: Annotated[int, msgspec.Meta(ge=2)] = 11
    base_weight: NonNegative = 10.0
    urgency_weight: NonNegative = 3.0
    time_window: Positive = 1.0  # s: urgency is 1/(1 + exp(slack / time_window))
    # s: a request the estimate has finishing later than this past its deadline even if it
    # started now is hopeless: it goes behind every other (run, it would be cut at its deadline).
    late_tolerance_s: Positive = 0.25
    resource_weight: Annotated[float, msgspec.Meta(ge=-1e6, le=1e6)] = -1.0  # < 0: short first
    resource_scale: Positive = 8.0  # resource = ln(prompt + predicted output tokens) / scale
    load_threshold: NonNegative = 0.8  # load = demand / executor slots
    load_weight: NonNegative = 1.0  # load_adjustment = 1 + (load - threshold) * load_weight ...
    load_adjustment_min: NonNegative = 0.5  # ... clamped to [min, max]
    load_adjustment_max: NonNegative = 2.0
    # Tenant fairness by virtual token counters: prompt + 2 x output tokens served, divided by
    # the tenant's weight; a tenant `fairness_scale_tokens` ahead of the least-served active
    # tenant loses `fairness_factor` points, `fairness_max` at most (so classes still count).
    fairness_factor: NonNegative = 1.0
    fairness_scale_tokens: Positive = 1000.0
    fairness_max: NonNegative = 3.0
    tenant_weights: dict[str, Positive] = {}  # absent tenants weigh 1
    # Aging bound: a request that has waited this long goes ahead of every request that has not.
    max_wait_s: Positive = 60.0
    # Predicted output = max_tokens x a moving average, per tenant and priority, of the share of
    # max_tokens requests really generate; `predictor_prior` until completions are seen.
    predictor_alpha: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.1
    predictor_prior: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    # Class SLO feedback: priority -> TTFT target (ms). While a class's p90 TTFT over the last
    # `class_feedback_window_s` misses its target, its class weight rises by `class_weight_step`
    # each `class_feedback_interval_s`, up to `class_weight_max`; it relaxes toward 1 when met.
    class_ttft_slo_ms: dict[int, Positive] = {}
    class_weight_max: Annotated[float, msgspec.Meta(ge=1.0)] = 2.0
    class_weight_step: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.1
    class_feedback_interval_s: Positive = 2.0
    class_feedback_window_s: Positive = 30.0


class BatchLevel(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Each executor's batch limits, and how far the batcher fills executors ahead."""

    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 128
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=16)] = 512
    # Requests an executor may hold beyond max_num_seqs, so a finished slot refills at once.
    executor_queue_depth: Annotated[int, msgspec.Meta(ge=0)] = 4
    # Late binding: an executor takes a request only while the prompt tokens it has yet to
    # prefill (and the KV blocks they need) fit in this many steps' token budget, so what it
    # accepts starts within about that many steps and the rest waits at priority, in the
    # policy's order. Larger keeps executors busier across dispatch delays; smaller decides
    # later. 4: at 2, a loaded 2-core host's dispatch round trip outlasted the room and steps
    # ran short of prefill (BENCHMARKS.md, "A wider intake horizon").
    intake_horizon_steps: Annotated[float, msgspec.Meta(gt=0.0)] = 4.0
    # Which executor with room gets a request: kv_aware scores each by the share of the prompt's
    # blocks it caches (its KV events say which) times kv_overlap_weight, minus its load (over
    # max_num_seqs) times kv_load_weight; least_loaded takes the least loaded (then the most
    # free KV blocks); round_robin each in turn.
    routing: Literal["kv_aware", "least_loaded", "round_robin"] = "kv_aware"
    kv_overlap_weight: NonNegative = 1.0
    kv_load_weight: NonNegative = 1.0
    # With no room anywhere, still send a request that outranks, by the preemption margin,
    # everything waiting at some executor (and its weakest running request, if every slot is
    # taken) there; it starts at once, ahead of them. At most `overtake_extra` beyond the room.
    overtaking_dispatch: bool = True
    overtake_extra: Annotated[int, msgspec.Meta(ge=0)] = 2
    # fixed: every executor runs up to max_num_seqs sequences at once; adaptive: each moves its
    # own limit by the scheduler.load_aware controller (max_num_seqs then plays no part).
    batch_size: Literal["fixed", "adaptive"] = "fixed"


Share = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class LoadAware(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The adaptive batch size (services/executor/batch_size.py): every `interval_s` each
    executor looks at the last interval and moves its limit on concurrent sequences by
    `step_size` within [min_batch_size, max_batch_size]. It shrinks when TPOT p99 broke
    `tpot_slo_ms`, when KV memory ran tight (a preemption, or free blocks under
    `kv_free_threshold` of the pool), or when the batch is under `low_load_threshold` of the
    limit with nothing waiting (latency first while load is low); it grows when requests wait,
    the batch fills at least `high_load_threshold` of the limit and TPOT p99 has headroom."""

    min_batch_size: Annotated[int, msgspec.Meta(ge=1)] = 4
    max_batch_size: Annotated[int, msgspec.Meta(ge=1)] = 128
    initial_batch_size: Annotated[int, msgspec.Meta(ge=1)] = 16
    step_size: Annotated[int, msgspec.Meta(ge=1)] = 4
    interval_s: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    high_load_threshold: Share = 0.9
    low_load_threshold: Share = 0.25
    tpot_slo_ms: Annotated[float, msgspec.Meta(gt=0.0)] = 100.0
    kv_free_threshold: Share = 0.05

    def __post_init__(self):
        if not self.min_batch_size <= self.initial_batch_size <= self.max_batch_size:
            raise ValueError("load_aware needs min_batch_size <= initial_batch_size <= "
                             "max_batch_size")
        if self.low_load_threshold >= self.high_load_threshold:
            raise ValueError("load_aware needs low_load_threshold < high_load_threshold")


class TokenLevel(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Overlap the CPU work of steps N+1 and N with the model's execution of step N.
    pipeline: bool = True
    # A waiting request preempts a running one only if its score is at least this much higher.
    preemption_margin: NonNegative = 1.0
    # While a running request with a deadline needs faster steps to finish in time (its time
    # left over its tokens left), steps give up prefill tokens until they are that fast ...
    deadline_pacing: bool = True
    # ... and then let the decodes of requests a preemption margin below it sit steps out
    # (their KV kept). Off: on SmolLM2 on a CPU at 1.5x capacity it cost a third of the
    # throughput for no measurable gain in deadlines met (docs/scheduling.md).
    pause_decodes: bool = False


class SchedulerSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    request_level: RequestLevel = msgspec.field(default_factory=RequestLevel)
    batch_level: BatchLevel = msgspec.field(default_factory=BatchLevel)
    token_level: TokenLevel = msgspec.field(default_factory=TokenLevel)
    load_aware: LoadAware = msgspec.field(default_factory=LoadAware)


class DistributedSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    heartbeat_interval_s: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    heartbeat_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 5.0  # then an executor is dead
    # SIGTERM: let running finish (a day at most: the stop timer takes a finite time)
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)] = 30.0
    # A durable request whose executor died continues from the outputs its checkpoints
    # reported (false: it runs again from the start, the baseline for loadtest.migration_bench).
    resume_from_checkpoints: bool = True
    # A streaming client whose inbox has no subscriber for this long is gone: its request is
    # cancelled. A client failing over to another NATS node is away for a moment, not gone.
    client_gone_after_s: Annotated[float, msgspec.Meta(ge=0.0)] = 3.0


Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class MetricsPorts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where each kind of service serves Prometheus `/metrics` (0: off). A process may override
    its own with `--metrics-port`; `jetserve up` gives executor i the executor port + i."""

    admission: Port = 9401
    priority: Port = 9402
    batcher: Port = 9403
    executor: Port = 9404


class MonitoringSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"  # auto: console on a terminal
    metrics: bool = True  # false: no service serves /metrics, whatever its port
    metrics_port: MetricsPorts = msgspec.field(default_factory=MetricsPorts)


# (Every float's bounds are written as floats: typing caches Annotated types by equal metadata,
# and gt=0 equals gt=0.0, so an int bound here could become the protocol's, and its published
# schema would then depend on which module's annotations were resolved first.)
Portion = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Count = Annotated[int, msgspec.Meta(ge=1)]


class TenantQuota(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What one tenant may ask of jetserve (docs/operations.md, "Quotas"). Past a limit of
    flow (concurrency, tokens, shares) a request gets `rate_limited` with `retry_after_ms`;
    past a limit of shape (prompt, max_tokens, stop strings, payload) `invalid_request` naming
    the key, since the same request would never fit. None: no limit of jetserve's own."""

    max_concurrent_requests: Count | None = None  # admitted and not yet ended
    # A token bucket over prompt + max_tokens of each request.
    tokens_per_s: Positive | None = None
    burst_tokens: Count = 100_000
    max_prompt_tokens: Count | None = None
    max_tokens: Count | None = None
    max_stop: Annotated[int, msgspec.Meta(ge=0)] = 64  # stop strings (and stop_token_ids)
    max_stop_length: Count = 256  # characters in one stop string
    max_payload_bytes: Count | None = None
    # Of scheduler.request_level.max_pending_requests, the waiting requests one tenant may
    # have at priority; and of the durable backlog (LLM_REQUESTS holds as many), its durable
    # requests admitted or waiting their turn: so no tenant fills either alone.
    queue_share: Portion = 0.5
    durable_share: Portion = 0.5


def share_limit(share: float, capacity: int) -> int | None:
    """How many of `capacity` places a share gives one tenant; None for the whole (a share of
    everything is no limit of its own: the capacity's own rules decide)."""
    return None if share >= 1 else max(1, int(share * capacity))


class QuotasSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, dict=True):
    default: TenantQuota = msgspec.field(default_factory=TenantQuota)
    # tenant -> the keys of `default` it has otherwise, e.g. {acme: {max_concurrent_requests: 8}}
    tenants: dict[str, dict[str, object]] = {}

    def __post_init__(self):
        self._of: dict[str, TenantQuota] = {}
        for tenant, keys in self.tenants.items():
            try:
                self._of[tenant] = msgspec.convert(
                    {**msgspec.to_builtins(self.default), **keys}, TenantQuota)
            except msgspec.ValidationError as exc:
                raise ValueError(f"{exc}, in quotas.tenants.{tenant}") from None

    def of(self, tenant: str) -> TenantQuota:
        return self._of.get(tenant, self.default)


class GatewaySection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The OpenAI-compatible HTTP gateway (`python -m services.gateway`, docs/openai.md)."""

    host: str = "127.0.0.1"  # 0.0.0.0 to serve other hosts (compose.yaml does)
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    # API key -> tenant. None configured: no key is asked for, every request is tenant
    # `default`. Configured: `Authorization: Bearer KEY` is required (401 without a known one).
    api_keys: dict[str, str] = {}
    # A JSON file of more API keys -> tenants, read again within a second of a change: the one
    # `jetserve tenant add|remove` keeps (`<state dir>/auth/api_keys.json`), which `jetserve up
    # --auth` and compose.yaml point the gateway at. Set, a key is always required.
    api_keys_file: str | None = None
    # Names the model is served under in `model` and /v1/models (empty: model.name).
    served_model_names: list[str] = []
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 600.0
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 8 * 1024 * 1024


class JetserveConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole of jetserve.yaml. Every key may be overridden by an environment variable
    `JETSERVE_<SECTION>__<KEY>` (e.g. `JETSERVE_KV_CACHE__BLOCK_SIZE=32`); `NATS_URL` sets
    `nats.url`."""

    nats: NatsSection = msgspec.field(default_factory=NatsSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    kv_cache: KvCacheSection = msgspec.field(default_factory=KvCacheSection)
    scheduler: SchedulerSection = msgspec.field(default_factory=SchedulerSection)
    distributed: DistributedSection = msgspec.field(default_factory=DistributedSection)
    monitoring: MonitoringSection = msgspec.field(default_factory=MonitoringSection)
    quotas: QuotasSection = msgspec.field(default_factory=QuotasSection)
    gateway: GatewaySection = msgspec.field(default_factory=GatewaySection)

    def engine_config(self, executor_name: str) -> EngineConfig:
        scheduler = self.scheduler
        batch, policy = scheduler.batch_level, scheduler.request_level
        if batch.batch_size == "adaptive":  # sized for the largest batch the controller may choose
            batch = msgspec.structs.replace(batch, max_num_seqs=scheduler.load_aware.max_batch_size)
        return EngineConfig(model=self.model, kv_cache=self.kv_cache, batch=batch,
                            token_level=scheduler.token_level, executor_name=executor_name,
                            max_wait_s=policy.max_wait_s if policy.policy == "adaptive" else None)


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What one engine runs on: the file's `model` and `kv_cache` sections and the scheduler's
    batch and token levels as they are (each knob has one default, and its checks run once),
    with the engine's name and the aging bound the request-level policy implies. Made by
    `JetserveConfig.engine_config`, or `engine_config(settings)` for an engine in-process."""

    model: ModelSection = msgspec.field(default_factory=ModelSection)
    kv_cache: KvCacheSection = msgspec.field(default_factory=KvCacheSection)
    batch: BatchLevel = msgspec.field(default_factory=BatchLevel)
    token_level: TokenLevel = msgspec.field(default_factory=TokenLevel)
    executor_name: str = "executor-0"
    # A request waiting this long since its arrival goes ahead of every request that has not,
    # and no such request may preempt it (None: off; the adaptive policy sets it).
    max_wait_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None


def engine_config(settings: Mapping[str, object] | None = None, **fields) -> EngineConfig:
    """An in-process engine's configuration: `--set`-style settings over the defaults
    (`{"model.name": "dummy:tiny", "kv_cache.num_blocks": 64}`, values as Python objects),
    validated as jetserve.yaml is, the environment left out; `fields` set EngineConfig's own
    (`max_wait_s`, `executor_name`). The aging bound is off unless given (a benchmark's order is
    the scores' alone), and the batch size is fixed: the adaptive controller is the executor
    service's."""
    tree: dict = {}
    for key, value in (settings or {}).items():
        *sections, last = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[last] = value
    config = _validated(tree)
    if config.scheduler.batch_level.batch_size == "adaptive":
        raise ConfigError("scheduler.batch_level.batch_size: adaptive needs the executor "
                          "service's controller; an in-process engine runs a fixed batch size")
    name = fields.pop("executor_name", "executor-0")
    return msgspec.structs.replace(config.engine_config(name), **{"max_wait_s": None, **fields})


class ConfigError(Exception):
    """A configuration file or variable that does not validate; the message names the key."""


ENV_PREFIX = "JETSERVE_"


def load_config(path: str | None = None, environ: Mapping[str, str] | None = None) -> JetserveConfig:
    """jetserve.yaml (when given), then environment overrides, validated as one tree."""
    import yaml

    environ = os.environ if environ is None else environ
    tree: dict = {}
    if path:
        try:
            tree = yaml.load(Path(path).read_text(), Loader=_loader()) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping")
    overrides = {k: v for k, v in environ.items()
                 if k.startswith(ENV_PREFIX) and _configures(k.removeprefix(ENV_PREFIX))}
    if environ.get("NATS_URL"):
        overrides.setdefault(f"{ENV_PREFIX}NATS__URL", environ["NATS_URL"])
    for name, raw in sorted(overrides.items()):
        keys = name.removeprefix(ENV_PREFIX).lower().split("__")
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: `{key}` is not a section")
        node[keys[-1]] = _env_value(raw)
    return _validated(tree)


def _loader():
    """YAML's safe loader, but a key given twice in one mapping is an error: YAML keeps the
    last (a section given twice lost the first one's keys without a word)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"`{key}` is given twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return Loader


def _configures(name: str) -> bool:
    """Whether `JETSERVE_<name>` is meant for the configuration: `<SECTION>__<KEY>`, or a
    section's name with one underscore for two (a typo load_config names). Others
    (JETSERVE_CPU_ARCH for the kernels' build, JETSERVE_CONTAINER_CLUSTER for the container
    test) are not: every key is in a section."""
    lower = name.lower()
    return "__" in name or any(lower.startswith(section + "_")
                               for section in JetserveConfig.__struct_fields__)


def _env_value(raw: str):
    """A variable's value, stripped, typed as YAML types it (32, true, null, [a, b]), but a
    text kept as it is: a password `abc #def` is not cut at what YAML reads as a comment, nor
    one starting with `*` or `@` refused. A text in quotes is the text inside them
    (`"123456"`: a string), as is one tagged `!!str`."""
    import yaml

    raw = raw.strip()  # (a secret made from a file ends in a newline)
    if not raw:
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""
    if isinstance(value, str) and not quoted and not raw.startswith("!!"):  # (!!str 1: a tag)
        return raw
    return value


def _validated(tree: dict) -> JetserveConfig:
    try:
        config = msgspec.convert(tree, JetserveConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
    check_timing(config)
    nats = config.nats
    kinds = [kind for kind, given in (("user/password",
                                       nats.user or nats.password or nats.password_file),
                                      ("token", nats.token), ("nkey_seed", nats.nkey_seed),
                                      ("creds", nats.creds)) if given]
    if len(kinds) > 1:
        raise ConfigError(f"nats: give one kind of credentials, not {' and '.join(kinds)}")
    if nats.password and nats.password_file:
        raise ConfigError("nats.password and nats.password_file: give one")
    if bool(nats.user) != bool(nats.password or nats.password_file):
        raise ConfigError("nats.user and nats.password (or nats.password_file) go together")
    if nats.tls and bool(nats.tls.cert) != bool(nats.tls.key):
        raise ConfigError("nats.tls.cert and nats.tls.key go together")
    if config.nats.client_inbox_prefix.split(".")[0] == config.nats.prefix:
        raise ConfigError(f"nats.client_inbox_prefix ({config.nats.client_inbox_prefix}) must not "
                          f"be under nats.prefix ({config.nats.prefix}): clients' answers would "
                          f"go to jetserve's own subjects")
    for key, tenant in config.gateway.api_keys.items():
        if not key or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", tenant):
            raise ConfigError(f"gateway.api_keys: a key must be non-empty and its tenant "
                              f"match [A-Za-z0-9_-]{{1,64}} (not {tenant!r})")
    return config


def check_timing(config: JetserveConfig) -> None:
    """Refuse timings under which a live holder would be taken for dead. Every holder
    (priority, the batcher, executors) reports what it holds once a heartbeat interval;
    admission hands a request on when nothing reported it for a lease (the heartbeat timeout),
    and keeps a held durable request's JetStream message alive with an in-progress ack every
    third of `ack_wait_s`, looked at once an interval."""
    interval = config.distributed.heartbeat_interval_s
    for key, value, why in (
            ("distributed.heartbeat_timeout_s", config.distributed.heartbeat_timeout_s,
             "holders report once an interval, admission looks once an interval, and a lease "
             "shorter than one late report plus both takes live holders for dead"),
            ("nats.ack_wait_s", config.nats.ack_wait_s, "held durable requests are kept alive "
             "once an interval, and JetStream would redeliver one that is still running")):
        if value < 3 * interval:
            raise ConfigError(f"{key} ({value:g}) must be at least three times "
                              f"distributed.heartbeat_interval_s ({interval:g}): {why}")


def nats_servers(url: str) -> list[str]:
    """`nats.url` as nats-py takes it: the servers of a comma-separated list (a cluster's
    nodes; the client picks one and fails over to the others)."""
    return [server.strip() for server in url.split(",") if server.strip()]


def env_overrides(settings: Mapping[str, object]) -> dict[str, str]:
    """`{"kv_cache.block_size": 32}` as the environment variables load_config reads (typed as
    YAML types them, as `--set KEY=VALUE` is)."""
    return {ENV_PREFIX + key.upper().replace(".", "__"):
            "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            for key, value in settings.items()}
