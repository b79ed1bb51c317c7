// A streaming generate request from Node.js over the public protocol (npm package `nats`).
// Usage: node stream.mjs NATS_URL TENANT PROMPT
// Prints one JSON line: the deltas' reassembled text and tokens beside the final Completion.
import { connect, Empty } from "nats";

const [url, tenant, prompt] = process.argv.slice(2);
const nc = await connect({ servers: url });
const request = {
  type: "generate",
  prompt,
  max_tokens: 32,
  ignore_eos: true,
  temperature: 0,
  stream: true,
};

const deltas = [];
let completion = null;
let sentinelLast = false;
// Streaming replies follow the request-many convention: they end with an empty message.
const replies = await nc.requestMany(
  `llm.generate.${tenant}`,
  JSON.stringify(request),
  { strategy: "sentinel", maxWait: 60000 },
);
for await (const msg of replies) {
  if (msg.data.length === 0) {
    sentinelLast = completion !== null;
    break;
  }
  const out = JSON.parse(new TextDecoder().decode(msg.data));
  if (out.type === "delta") deltas.push(out);
  else completion = out;
}
await nc.drain();

let next = 0;
let contiguous = true;
for (const d of deltas) {
  if (d.index !== next) contiguous = false;
  next += d.token_ids.length;
}
console.log(JSON.stringify({
  deltas: deltas.length,
  text: deltas.map((d) => d.text).join(""),
  token_ids: deltas.flatMap((d) => d.token_ids),
  contiguous,
  sentinelLast,
  completion,
}));
