"""What an executor tells Prometheus and the trace: vLLM's metric names (`vllm:` there,
`jetserve:` here), labelled by model and executor, and each request's span with its prefill and
decode as children. Observations are made as outputs go out; what the engine already counts is
read at scrape time, so the step loop pays nothing for metrics."""

from __future__ import annotations

from services.executor.engine.llm_engine import Engine
from shared.messages import WorkItem
from shared.metrics import (
    ITL_BUCKETS,
    REQUEST_BUCKETS,
    TTFT_BUCKETS,
    Reading,
    counter,
    histogram,
)
from shared.protocol import Completion, Error
from shared.telemetry import Span, context_of

_LABELS = ("model_name", "executor")
REQUEST_SUCCESS = counter("request_success", "Requests ended with a Completion, by finish reason",
                          (*_LABELS, "finished_reason"))
PROMPT_TOKENS = counter("prompt_tokens", "Prompt tokens of the requests that ended with a "
                        "Completion (prefix-cache hits included)", _LABELS)
ERRORS = counter("errors", "Requests ended with an Error at this executor, by code",
                 (*_LABELS, "code"))
TTFT = histogram("time_to_first_token_seconds",
                 "From admission to the first token (observed when the request ends)", _LABELS,
                 TTFT_BUCKETS)
ITL = histogram("inter_token_latency_seconds",
                "Between consecutive deltas sent to a streaming client", _LABELS, ITL_BUCKETS)
TPOT = histogram("request_time_per_output_token_seconds",
                 "Per request: decode time over its output tokens after the first", _LABELS,
                 ITL_BUCKETS)
E2E = histogram("e2e_request_latency_seconds", "From admission to the Completion", _LABELS,
                REQUEST_BUCKETS)
QUEUE_TIME = histogram("request_queue_time_seconds", "From admission to the request's first step",
                       _LABELS, REQUEST_BUCKETS)


class Observer:
    """One executor's metrics and spans. With `monitoring.metrics` off it observes nothing."""

    def __init__(self, tracer, model_name: str, executor: str, measuring: bool):
        self.tracer, self.measuring = tracer, measuring
        self.labels = (model_name, executor)
        self.metrics = {m: m.labels(*self.labels)
                        for m in (TTFT, ITL, TPOT, E2E, QUEUE_TIME, PROMPT_TOKENS)}

    def inter_token(self, seconds: float) -> None:
        if self.measuring:
            self.metrics[ITL].observe(seconds)

    def ended(self, span: Span, item: WorkItem, output: Completion | Error) -> None:
        """A request's final output: its metrics, and its span ended."""
        if isinstance(output, Error):
            if self.measuring:
                ERRORS.labels(*self.labels, output.code).inc()
            span.set_attribute("error", output.code)
            span.end()
            return
        m, usage = output.metrics, output.usage
        if self.measuring:
            REQUEST_SUCCESS.labels(*self.labels, output.finish_reason).inc()
            self.metrics[PROMPT_TOKENS].inc(usage.prompt_tokens)
            self.metrics[E2E].observe(m.e2e_ms / 1e3)
            self.metrics[QUEUE_TIME].observe(m.queue_ms / 1e3)
            if usage.completion_tokens:
                self.metrics[TTFT].observe(m.ttft_ms / 1e3)
            if usage.completion_tokens > 1:
                self.metrics[TPOT].observe(m.tpot_ms / 1e3)
        span.set_attributes({"completion_tokens": usage.completion_tokens,
                             "cached_tokens": usage.cached_tokens,
                             "finish_reason": output.finish_reason})
        if usage.completion_tokens:  # prefill and decode as child spans, on the wall clock
            arrival_ns = int(item.arrival_time * 1e9)
            for name, start, end in (("prefill", m.queue_ms, m.ttft_ms),
                                     ("decode", m.ttft_ms, m.e2e_ms)):
                self.tracer.start_span(name, context=context_of(span),
                                       start_time=arrival_ns + int(start * 1e6)
                                       ).end(end_time=arrival_ns + int(end * 1e6))
        span.end()

    def readings(self, engine: Engine, num_waiting: int) -> list[Reading]:
        """What the engine already counts, read at scrape time (nothing on the step loop)."""
        scheduler, blocks, stats = engine.scheduler, engine.block_manager, engine.stats
        labels = dict(zip(_LABELS, self.labels))
        return [
            Reading("gauge", "num_requests_running", "Requests in the running batch",
                    len(scheduler.running), labels),
            Reading("gauge", "num_requests_waiting", "Requests here waiting for a slot",
                    num_waiting, labels),
            Reading("gauge", "kv_cache_usage_perc", "KV-cache blocks in use (1 = full)",
                    1 - blocks.num_free_blocks / blocks.num_blocks, labels),
            *(Reading("gauge", "kv_pool_usage_perc", "KV-cache blocks in use in one pool "
                      "(1 = full)", 1 - free / total, {**labels, "pool": dtype})
              for dtype, total, free in kv_pools(engine)),
            Reading("counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix "
                    "cache", blocks.prefix_queries, labels),
            Reading("counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache",
                    blocks.prefix_hits, labels),
            Reading("counter", "num_preemptions", "Requests preempted (recomputed later)",
                    scheduler.num_preemptions, labels),
            Reading("counter", "prefill_tokens_computed", "Prompt tokens run through the model "
                    "(prefix-cache hits left out, recomputation after preemption counted)",
                    stats.prompt_tokens, labels),
            Reading("counter", "generation_tokens", "Tokens generated", stats.generated_tokens,
                    labels),
            *([Reading("gauge", "cpu_threads", "Torch threads of the CPU engine's steps (one "
                       "fewer for each core other processes keep busy)", engine.torch_threads,
                       labels)] if engine.torch_threads is not None else []),
        ]


def kv_pools(engine: Engine) -> list[tuple[str, int, int]]:
    """(dtype, blocks, free blocks) of each KV pool: one, or two with
    kv_cache.compress_below_priority."""
    return [(dtype, pool.num_blocks, pool.num_free_blocks)
            for dtype, pool in zip(engine.kv_pool_dtypes, engine.block_manager.pools)]
