"""The OpenAI-compatible HTTP API: a client of the gateway's public gRPC API (no second path into
the pipeline) that speaks /v1/chat/completions, /v1/completions and /v1/models."""
