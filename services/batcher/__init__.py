"""The batcher: tracks executors from their heartbeats, pulls work from priority when they have
room, and routes each request to an executor."""
