"""The worker's KV cache events: which fixed-size token pages its radix tree holds,
published in vLLM's wire format (`sgl/kv_events/wire.py`) for routers to index.

`config.py` parses `--kv-events-config`; `pages.py` watches the radix tree and turns
its token-granular changes into page events; `publisher.py` sends them over ZMQ (PUB,
replay ROUTER, heartbeat); `stream.py` wires the two into the worker loop.
"""
