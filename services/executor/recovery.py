"""What lets admission hand this executor's requests on if it dies (services/admission/ledger.py
decides): every heartbeat interval, the requests it holds, and a checkpoint of each one's outputs
generated since the previous report, in reports that fit one message each."""

from __future__ import annotations

from services.executor.engine.llm_engine import Engine
from shared.bus import chunked
from shared.messages import Holding, Progress, ended_bytes, holding_entry_bytes, progress_bytes


def holding_reports(holder: str, running: dict, engine: Engine, budget: int,
                    ended: list = (), answering=()) -> list[Holding]:
    """`running`: the executor's requests by key, each with its WorkItem (`item`) and how many
    of its outputs a checkpoint has reported (`reported`, advanced here); `ended`: the requests
    it answered lately (shared.bus.Outbox.recently_ended); `answering`: the keys of those whose
    final answer is being sent (held still: a store or claim waiting on JetStream is not a
    lost request)."""
    held, progress = list(answering), []
    for key, entry in running.items():
        item = entry.item
        held.append(key)
        outputs = engine.output_token_ids(key)
        if outputs is not None and len(outputs) > entry.reported:
            # In pieces that fit a report, in order (admission appends them as they come).
            step = max(1, budget // 10)
            for start in range(entry.reported, len(outputs), step):
                progress.append(Progress(item.tenant, item.request_id, item.attempt, start,
                                         outputs[start:start + step]))
            entry.reported = len(outputs)
    reports = [Holding(holder=holder, requests=part)
               for part in chunked(held, holding_entry_bytes, budget)]
    reports += [Holding(holder=holder, requests=[], progress=part)
                for part in chunked(progress, progress_bytes, budget)]
    reports += [Holding(holder=holder, requests=[], ended=part)
                for part in chunked(list(ended), ended_bytes, budget)]
    return reports
