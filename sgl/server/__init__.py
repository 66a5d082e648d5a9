"""HTTP server for `sgl`: SGLang's native API, the OpenAI-compatible API, and /metrics.

`sgl.server.app.create_app(engine)` builds the FastAPI app; `python -m sgl.launch_server`
runs it with uvicorn.
"""
