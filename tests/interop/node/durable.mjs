// A durable request from Node.js over the public protocol (npm package `nats`): a JetStream
// publish on llm.requests.<tenant>.<request_id>, a repeat JetStream refuses while the first
// waits or runs, and the result read from LLM_RESULTS.
// Usage: node durable.mjs NATS_URL TENANT REQUEST_ID PROMPT
// Prints one JSON line: the PubAck's stream, the repeat's refusal, the stored result.
import { connect } from "nats";

const [url, tenant, requestId, prompt] = process.argv.slice(2);
const nc = await connect({ servers: url });
const js = nc.jetstream();
const jsm = await nc.jetstreamManager();
// 128 tokens: still running when the repeat comes, even if this process waits a while for a
// core (the executor's threads busy on the same machine), so JetStream refuses the repeat.
const request = { type: "generate", prompt, max_tokens: 128, ignore_eos: true, temperature: 0 };
const subject = `llm.requests.${tenant}.${requestId}`; // the subject is the request's key

const ack = await js.publish(subject, JSON.stringify(request));
let repeat = "accepted";
try {
  await js.publish(subject, JSON.stringify(request));
} catch (err) {
  repeat = err.api_error?.description ?? err.message; // "maximum messages per subject exceeded"
}

let result = null;
for (let waited = 0; result === null && waited < 60000; waited += 100) {
  try {
    const stored = await jsm.direct.getMessage("LLM_RESULTS", {
      last_by_subj: `llm.results.${tenant}.${requestId}`,
    });
    result = stored.json();
  } catch {
    await new Promise((resolve) => setTimeout(resolve, 100)); // not stored yet
  }
}
await nc.drain();
console.log(JSON.stringify({ stream: ack.stream, repeat, result }));
