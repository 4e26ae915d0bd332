"""Serving: the engine (continuous batching over MLA pages and KDA slots, prefix cache, sampling),
the offline `LLM` API, the OpenAI-compatible HTTP server and multi-host stepping (ARCHITECTURE.md,
"The path of a request")."""
