"""The OpenAI-compatible HTTP gateway: `/v1/chat/completions`, `/v1/completions` and friends over
jetserve's public NATS protocol (docs/openai.md)."""
