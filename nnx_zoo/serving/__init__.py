"""Serving a model over the OpenAI HTTP API (`serve_main.py`): the device side of continuous
batching (`slots`: decode slots over one KV cache, prefill per length bucket), per-row
sampling (`sampling`), the scheduler and engine thread (`scheduler`, `engine`), the request
and response models (`protocol`) and the FastAPI app (`api`; extra `[serve]`)."""
