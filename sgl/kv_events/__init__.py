"""KV cache events: the wire format workers publish and routers read (vLLM's format).

One home for the message types (`wire.py`) and the page hash chain (`hashing.py`), so the
publisher in the worker and the index in the router can never disagree. Imports nothing
else from `sgl`: both the runtime and the router depend on it.
"""
