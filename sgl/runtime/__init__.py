"""The inference engine: scheduler, KV memory, model, attention, constrained decoding.

OpenMP threads that spin while waiting make bf16 matmuls 10-100x slower as soon as a
second busy process shares these few cores (a server beside its client, tests beside a
server). Sleeping waiters cost little when the machine is idle, so it is the default
here; it only takes effect if set before torch is first imported.
"""

import os

# Outside config.py on purpose: OpenMP's own variable, and it must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
