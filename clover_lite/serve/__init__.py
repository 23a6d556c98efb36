"""clover serve: the engine behind an OpenAI-compatible HTTP API (starlette + uvicorn, the serve extra)."""
