"""Internal messages between the services (msgpack on `llm.internal.*` subjects)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.keys import RequestKey
from shared.protocol import Error, GenerateRequest


# What a WorkItem's encoding may grow by between admission and an executor (the scores and the
# trace context priority writes into it).
DISPATCH_BYTES = 256


class WorkItem(msgspec.Struct, kw_only=True):
    """An admitted request on its way through priority and batcher to an executor."""

    # Tokenized: `prompt_token_ids` is set (prompt and messages cleared); request_id and seed given.
    request: GenerateRequest
    tenant: str
    arrival_time: float  # wall clock (s since the epoch), stamped by admission
    deadline: float | None = None  # wall clock; from deadline_ms
    reply_to: str | None = None  # the client's inbox on llm.generate; None for a durable request
    durable: bool = False
    trace: dict[str, str] = {}  # W3C trace context of the latest hop's span
    # Set by priority at dispatch. The executor orders and preempts by `standing`, the part of
    # the score that does not move with the clock (all but deadline urgency): it compares
    # requests dispatched at different moments, when their urgencies are not comparable.
    priority_score: float = 0.0
    standing: float = 0.0
    queue_wait_ms: float = 0.0
    # The tenant was over its share: its aging bound held it only within its own line, so the
    # executor's bound counts from dispatch, not arrival (it still cannot starve there).
    age_from_dispatch: bool = False
    # The chained hashes of the prompt's full KV blocks (shared/block_hash.py), computed once by
    # admission: the batcher routes by cached prefix without tokenizing.
    block_hashes: list[bytes] = []
    # A durable request handed on from an executor that died: the outputs its checkpoints had
    # reported (generation continues after them), and which hand-off this is (0: the first
    # run). An executor still running an earlier attempt is told to drop it (Revoke).
    resume_token_ids: list[int] = []
    attempt: int = 0
    # Set by the batcher for each assignment it sends: an assignment it gave up on (no answer
    # in time) is withdrawn by this token (Unassign), so a late acceptance never runs a request
    # that went back to the queue.
    assignment: str = ""
    # A holder of this attempt lapsed while it held it (cut off from NATS, or stalled for part
    # of a lease: shared/bus.py Lapses): admission may have taken it for dead and handed the
    # request on, and the revoke may not have reached it. A generate's answer is then claimed
    # first (Outbox.final), as a handed-on attempt's is.
    lapsed: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def key(self) -> RequestKey:
        return RequestKey(self.tenant, self.request.request_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)


class SubmitReply(msgspec.Struct):
    """priority's answer to admission: queued, or an Error (`overloaded`) to pass on."""

    error: Error | None = None


class NextRequest(msgspec.Struct):
    """batcher asks priority for the best `max_items` requests, waiting up to `wait_ms` for one."""

    max_items: int
    wait_ms: int
    # Only requests whose standing reaches this (overtaking dispatch: each goes to an executor
    # without room, ahead of what waits or runs there); None: any request.
    min_standing: float | None = None
    # The reply's byte budget: what the batcher's connection may receive in one message (0: the
    # priority's own). Requests stop being added at it, whatever `max_items` says.
    max_bytes: int = 0


class NextReply(msgspec.Struct):
    items: list[WorkItem]


class AssignReply(msgspec.Struct):
    accepted: bool
    reason: str = ""


# A count in a heartbeat: a negative one (a bug, or a forged beat) would read as room.
Count = Annotated[int, msgspec.Meta(ge=0)]


class Heartbeat(msgspec.Struct, kw_only=True):
    """An executor's load, published every interval and whenever a request starts or ends. One
    out of its bounds is refused whole where it is decoded (the batcher's, priority's)."""

    executor: str
    model: str
    max_num_seqs: Count
    queue_depth: Count  # requests it accepts beyond max_num_seqs
    running: Count
    waiting: Count
    assigned_total: Count  # assignments received since start (the batcher counts those in flight)
    free_kv_blocks: Count
    total_kv_blocks: Count
    # mean time a step took over the last interval, gaps between steps included (at most an
    # hour: one huge value would make every deadline look hopeless at priority)
    step_ms: Annotated[float, msgspec.Meta(ge=0.0, le=3.6e6)]
    started_at: float  # wall clock; a restart shows as a new value
    tenants: dict[str, Count] = {}  # requests each tenant has here (running or waiting)
    # The standing a request needs to start here at once although there is no room: to go ahead
    # of every waiting request and, with every slot taken, to preempt the weakest running one
    # (see Scheduler.overtake_above); None when nothing is in the way or it was aged.
    overtake_above: float | None = None
    # Prompt tokens it can take on now and start within its intake horizon
    # (Scheduler.intake_room); at most 0: none until what it has is under way. None: no limit.
    room_tokens: int | None = None


class KvEvent(msgspec.Struct, kw_only=True):
    """Prefix blocks an executor's cache gained (`stored`) or lost (`removed`) since its previous
    event, by chained block hash. Numbered from 1 by each executor instance (`started_at`), so a
    receiver that sees a gap, or an instance it joined late, asks for a KvDump."""

    executor: str
    started_at: float
    seq: int
    stored: list[bytes] = []
    removed: list[bytes] = []


class KvDump(msgspec.Struct, kw_only=True):
    """Every prefix block an executor caches, as of its event `seq` (0: before any event)."""

    executor: str
    started_at: float
    seq: int
    blocks: list[bytes]
    # A dump larger than one message is several replies to the same request: this one's place
    # among them, and whether it is the last.
    part: int = 0
    last: bool = True


class Progress(msgspec.Struct, array_like=True):
    """A checkpoint: the outputs a running durable request generated since the last report."""

    tenant: str
    request_id: str
    attempt: int  # the WorkItem's
    index: int  # the output position of token_ids[0]
    token_ids: list[int]


class Ended(msgspec.Struct, array_like=True):
    """A request answered: which one (ids may be reused: its arrival time tells them apart)."""

    tenant: str
    request_id: str
    arrival_time: float  # the WorkItem's

    @property
    def key(self) -> RequestKey:
        return RequestKey(self.tenant, self.request_id)


def ended_bytes(ended: Ended) -> int:
    """An upper bound on the bytes one Ended adds to a Holding."""
    return len(ended.tenant.encode()) + len(ended.request_id.encode()) + 16


class Holding(msgspec.Struct):
    """The requests a service holds right now (priority: waiting; an executor: running), durable
    and generates alike, published every heartbeat interval. Admission watches over every
    request until its Done: one that no service reports (lost with a dead service) goes back to
    the queue with the outputs its checkpoints (`progress`, executors only) reported, and
    continues from there."""

    holder: str
    requests: list[RequestKey]
    progress: list[Progress] = []
    # Requests it gave their final answer lately (for a few seconds): their Done, or the
    # tombstone of their state, may have been lost in a failover, and a request taken for lost
    # would run again. Admission ends them as a Done would.
    ended: list[Ended] = []


def holding_entry_bytes(key: RequestKey) -> int:
    """An upper bound on the bytes one (tenant, request_id) adds to a Holding."""
    return len(key[0].encode()) + len(key[1].encode()) + 8


def progress_bytes(progress: Progress) -> int:
    """An upper bound on the bytes one Progress adds to a Holding (a token id: 5 at most)."""
    return (len(progress.tenant.encode()) + len(progress.request_id.encode()) + 24
            + 5 * len(progress.token_ids))


class CancelRequest(msgspec.Struct, array_like=True):
    """Admission to priority and every executor: a client cancelled this request, which is in
    flight (waiting, or on its way to or at an executor)."""

    tenant: str
    request_id: str
    cancelled_at: float  # admission's wall clock, as the WorkItem's arrival_time


class Revoke(msgspec.Struct, array_like=True):
    """To every executor and priority: drop this attempt (or an earlier one) of a request,
    without an answer; admission handed the request on after taking its holder for dead."""

    tenant: str
    request_id: str
    attempt: int


class Backpressure(msgspec.Struct):
    """Priority to admission while its waiting queue is full: each tenant whose new requests it
    would refuse (the tenants holding the most of the queue), with the highest priority it would
    refuse of that tenant (a newcomer of a higher class could take the place of one of the
    tenant's own lower-class requests). Admission refuses those at once, before any other work:
    a flood costs it little, and what other tenants send is not held up behind the flood.
    Published on every change and each heartbeat interval while it lasts; an empty `tenants`
    ends it, and admission forgets one not renewed within three intervals."""

    tenants: dict[str, int] = {}


def tenant_entry_bytes(entry: tuple[str, int]) -> int:
    """An upper bound on the bytes one tenant and a small integer add to a map of them (a
    Heartbeat's `tenants`, a Backpressure's)."""
    return len(entry[0].encode()) + 8


class Unassign(msgspec.Struct, array_like=True):
    """The batcher to one executor: it gave up waiting for that executor's answer to an
    assignment and put the request back in the queue. The executor drops it if it runs it, and
    refuses it if the assignment has not arrived yet."""

    tenant: str
    request_id: str
    assignment: str


class Done(msgspec.Struct, array_like=True):
    """A request has its final answer: a durable one's is stored in LLM_RESULTS, a generate's
    sent to its client. The one end-of-request signal, on `llm.internal.done`, from whoever
    answered: admission stops watching over the request (and acks a durable one), priority
    corrects its tenant's advance charge and learns its output length and TTFT."""

    tenant: str
    request_id: str
    durable: bool
    arrival_time: float  # the WorkItem's: which request of that key (ids may be reused)
    priority: int
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    ttft_ms: float | None  # from admission's arrival stamp; None when no token was generated
    finish_reason: str  # a Completion's finish_reason, else the Error's code

    @property
    def key(self) -> RequestKey:
        return RequestKey(self.tenant, self.request_id)


encode = msgspec.msgpack.Encoder().encode


decoder = msgspec.msgpack.Decoder
