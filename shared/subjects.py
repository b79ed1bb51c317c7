"""Every NATS subject and stream jetserve uses, built from one configurable prefix (default `llm`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.keys import RequestKey

REQUESTS_STREAM = "LLM_REQUESTS"
RESULTS_STREAM = "LLM_RESULTS"
ADMISSION_CONSUMER = "admission"

# A tenant comes from the subject, never the payload, so NATS permissions can confine it.
TENANT_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A durable request id is a subject token: llm.requests.<tenant>.<request_id> (the request's key,
# one message at a time per subject) and llm.results.<tenant>.<request_id>.
DURABLE_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")


# Every result the services store says whose it is: `<tenant>/<request_id>`, and ` retryable`
# after it for a refusal the same id may be sent again after. A message on a result subject
# without it is not a result: JetStream answers a client's publish or direct get on whatever
# reply subject the client names, and a stream captures that answer like any message.
RESULT_HEADER = "Jetserve-Result"


def final_result(headers: dict[str, str] | None, tenant: str, request_id: str) -> bool:
    """Whether a message stored on `llm.results.<tenant>.<request_id>` is that request's final
    result (not a retryable refusal, not something else a reply put there)."""
    return (headers or {}).get(RESULT_HEADER) == f"{tenant}/{request_id}"


def retryable_result(headers: dict[str, str] | None, tenant: str, request_id: str) -> bool:
    """Whether it is a refusal of the request the same id may be sent again after."""
    return (headers or {}).get(RESULT_HEADER) == f"{tenant}/{request_id} retryable"


def client_reply(subject: str, inbox_prefix: str, tenant: str | None = None) -> bool:
    """Whether a request's reply subject may carry its answers: a subject under the clients'
    inbox prefix (`nats.client_inbox_prefix`), with no wildcard, and under
    `<inbox prefix>.<tenant>` when a tenant is given (`nats.tenant_inboxes`). Never a subject
    under jetserve's prefix or a `$` subject (the inbox prefix can be neither): a reply subject
    is the client's word, and answering it unchecked would let any client publish as a service
    (or, with tenants' inboxes, into another tenant's)."""
    head = inbox_prefix.split(".") + ([tenant] if tenant is not None else [])
    tokens = subject.split(".")
    return (len(tokens) > len(head) and tokens[:len(head)] == head
            and all(token not in ("", "*", ">") for token in tokens))


@dataclass(frozen=True)
class Subjects:
    prefix: str = "llm"

    # ------------------------------------------------------------------ public (protocol v2)
    def generate(self, tenant: str = "*") -> str:
        return f"{self.prefix}.generate.{tenant}"

    def requests(self, tenant: str = "*", request_id: str = "*") -> str:
        return f"{self.prefix}.requests.{tenant}.{request_id}"

    @property
    def all_requests(self) -> str:
        """What LLM_REQUESTS keeps: durable submissions, and protocol v1's, which had no id
        token (`llm.requests.<tenant>`) and get an Error saying so."""
        return f"{self.prefix}.requests.>"

    def results(self, tenant: str = "*", request_id: str = "*") -> str:
        return f"{self.prefix}.results.{tenant}.{request_id}"

    def stream(self, tenant: str, request_id: str) -> str:
        return f"{self.prefix}.stream.{tenant}.{request_id}"

    def cancel(self, tenant: str = "*") -> str:
        return f"{self.prefix}.cancel.{tenant}"

    def durable_key(self, subject: str) -> RequestKey | None:
        """The tenant and id of a durable submission's subject (`llm.requests.<tenant>.<id>`),
        or None when it names none (protocol v1's `llm.requests.<tenant>`, invalid tokens)."""
        tokens = subject.split(".")
        if (len(tokens) == 4 and TENANT_PATTERN.fullmatch(tokens[2])
                and DURABLE_ID_PATTERN.fullmatch(tokens[3])):
            return RequestKey(tokens[2], tokens[3])
        return None

    def tenant_of(self, subject: str) -> str:
        """The tenant token of a public subject (`llm.<verb>.<tenant>[...]`)."""
        parts = subject.split(".")
        return parts[2] if len(parts) >= 3 else ""

    # --------------------------------------------------------------------------- internal
    @property
    def priority_submit(self) -> str:
        return f"{self.prefix}.internal.priority.submit"

    @property
    def priority_next(self) -> str:
        return f"{self.prefix}.internal.priority.next"

    def executor_assign(self, executor: str) -> str:
        return f"{self.prefix}.internal.executor.{executor}.assign"

    def executor_unassign(self, executor: str) -> str:
        """The batcher to one executor: an assignment it gave up on (Unassign)."""
        return f"{self.prefix}.internal.executor.{executor}.unassign"

    @property
    def batcher_executors(self) -> str:
        return f"{self.prefix}.internal.batcher.executors"

    @property
    def heartbeat(self) -> str:
        return f"{self.prefix}.internal.heartbeat"

    @property
    def holding(self) -> str:
        return f"{self.prefix}.internal.holding"

    @property
    def cancels(self) -> str:
        """Admission to priority and every executor: a client's cancel of a request admission
        knows to be in flight (a cancel of anything else goes no further than admission)."""
        return f"{self.prefix}.internal.cancel"

    @property
    def revoke(self) -> str:
        """Admission to every executor: drop an attempt of a durable request handed on."""
        return f"{self.prefix}.internal.revoke"

    @property
    def backpressure(self) -> str:
        """Priority to admission: the tenants whose new requests a full queue refuses."""
        return f"{self.prefix}.internal.admission.backpressure"

    @property
    def admissions(self) -> str:
        """Each admission to the others, every heartbeat interval: its name (the owner of the
        request states it keeps in LLM_STATE), so they take those over once it falls silent."""
        return f"{self.prefix}.internal.admission.alive"

    @property
    def done(self) -> str:
        """Whoever answered a request, to admission and priority: it has its final answer."""
        return f"{self.prefix}.internal.done"

    @property
    def kv_events(self) -> str:
        """Executors' KvEvents: the prefix blocks their caches gained and lost."""
        return f"{self.prefix}.internal.kv.events"

    def kv_dump(self, executor: str) -> str:
        """Request/reply: an executor's KvDump, every prefix block it caches."""
        return f"{self.prefix}.internal.kv.dump.{executor}"
