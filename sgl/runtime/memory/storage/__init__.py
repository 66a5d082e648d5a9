"""Storage tier (L3) backends for the hierarchical KV cache: one protocol (`base.py`),
one file per backend, picked by name with `make_backend` (lazy imports)."""
