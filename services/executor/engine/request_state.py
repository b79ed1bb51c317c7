"""What the engine keeps per request besides its sequence: text, stop checks, timings, outputs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.executor.engine.sequence import Sequence
from shared.tokenizer import IncrementalDetokenizer
from shared.protocol import Completion, Delta, FinishReason, Metrics, Scheduling, Usage


@dataclass(eq=False)
class RequestState:
    seq: Sequence
    request_id: str  # as the client gave it (or admission chose): what every output names
    model: str
    executor: str
    detokenizer: IncrementalDetokenizer
    eos_token_id: int | None
    max_model_len: int
    stream: bool
    sink: Callable[[object], None]  # receives this request's Deltas and its final output
    text: str = ""
    emitted_text_len: int = 0  # characters already sent in deltas
    emitted_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    timers: list[asyncio.TimerHandle] = field(default_factory=list)  # deadline, aging
    stop_holdback: int = field(init=False)

    def __post_init__(self):
        # A delta never ends inside what could be the start of a stop string.
        self.stop_holdback = max((len(s) for s in self.seq.sampling.stop), default=1) - 1

    def append_token(self, token: int) -> None:
        """Take one sampled token; sets `finish_reason` when a stop condition is met."""
        seq, sampling = self.seq, self.seq.sampling
        seq.num_pending -= 1
        seq.token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        new_text = self.detokenizer.add([token])
        if (token == self.eos_token_id and not sampling.ignore_eos) or token in sampling.stop_token_ids:
            self.finish_reason = "stop"
            return
        if new_text:
            self.text += new_text
            if sampling.stop and self._truncate_at_stop(len(new_text)):
                self.finish_reason = "stop"
                return
        if (len(seq.token_ids) - seq.num_prompt_tokens >= sampling.max_tokens
                or len(seq.token_ids) >= self.max_model_len):
            self.finish_reason = "length"

    def _truncate_at_stop(self, new_len: int) -> bool:
        longest = self.stop_holdback + 1
        search_from = max(0, len(self.text) - new_len - longest + 1)
        hits = [i for s in self.seq.sampling.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        return True

    def take_delta(self, final: bool = False) -> Delta | None:
        """New tokens and the text that is safe to send, since the last delta; all of it when
        the request is ending (finished or cancelled), so deltas add up to the Completion."""
        tokens = self.seq.output_token_ids
        end = len(self.text) if final else max(
            self.emitted_text_len, len(self.text) - self.stop_holdback)
        if len(tokens) == self.emitted_tokens and end == self.emitted_text_len:
            return None
        delta = Delta(request_id=self.request_id, index=self.emitted_tokens,
                      token_ids=tokens[self.emitted_tokens:],
                      text=self.text[self.emitted_text_len:end])
        self.emitted_tokens = len(tokens)
        self.emitted_text_len = end
        return delta

    def completion(self) -> Completion:
        now, seq = time.monotonic(), self.seq
        arrival, num_out = seq.arrival_time, len(seq.output_token_ids)
        e2e, ttft = now - arrival, (self.first_token_time or now) - arrival
        return Completion(
            request_id=self.request_id, model=self.model, text=self.text,
            token_ids=seq.output_token_ids, finish_reason=self.finish_reason or "cancelled",
            usage=Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=num_out,
                        cached_tokens=seq.num_cached_tokens),
            metrics=Metrics(queue_ms=1e3 * ((self.first_scheduled_time or now) - arrival),
                            ttft_ms=1e3 * ttft, e2e_ms=1e3 * e2e,
                            tpot_ms=1e3 * (e2e - ttft) / (num_out - 1) if num_out > 1 else 0.0),
            scheduling=Scheduling(priority_score=seq.score, executor=self.executor,
                                  preemptions=seq.preemptions,
                                  recomputed_tokens=seq.recomputed_tokens))
