"""The router: one HTTP front for N workers (`python -m sgl.launch_router`).

It proxies SGLang's native and OpenAI APIs, picks a worker per request with a policy
(`policies/`: cache-aware, KV-event-aware, round robin, random, power of two), retries
requests that failed before any byte reached the client, and keeps workers that fail
health checks out of rotation. In PD mode (`--pd-disaggregation`) it pairs a prefill and a
decode worker per request (`pd_proxy.py`), as sglang-router does. It imports `sgl.radix`
and `sgl.kv_events`, and no runtime: all it knows of a worker is its HTTP contract.
"""
