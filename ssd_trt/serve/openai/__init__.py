"""OpenAI-compatible HTTP server over the shared serving loop (``serve/core.py``): FastAPI + uvicorn.

    python -m ssd_trt.serve.openai build/smollm2-135m --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not), ``/v1/models``, ``/health``,
``/metrics``. See docs/serving.md ("OpenAI-compatible server").
"""
from __future__ import annotations
