"""The loop of a tensor-parallel rank other than 0: run every step rank 0 broadcasts.

Each `Forward` (ipc/messages.py) first replays rank 0's writes to the request -> token
table on this rank's copy and the KV copies between the device pool and the host tier
on this rank's heads, then runs the same ForwardBatch through this rank's shard; the
model's collectives pair with rank 0's. Sampling, grammars and the scheduler exist only
on rank 0. The loop ends on a stop message, or with an error when rank 0 is gone.
"""

from __future__ import annotations

import logging
from typing import Any

from sgl.runtime.distributed.peers import PlanBroadcast
from sgl.runtime.executor.step import to_batch
from sgl.runtime.memory.host_pool import run_copies

log = logging.getLogger("sgl.worker")


def run_follower(runner: Any, table: Any, peers: PlanBroadcast, device: str, host_pool: Any = None,
                 kv_pool: Any = None) -> int:
    """Returns the process exit code: 0 when rank 0 said stop, 1 when it vanished."""
    steps = 0
    while True:
        try:
            fwd = peers.recv()
        except Exception as e:
            log.error("rank 0 is gone after %d steps (%s); exiting", steps, e)
            return 1
        if fwd.stop:
            return 0
        for row, start, slots in fwd.table_writes:
            table.write(row, start, slots)
        if fwd.kv_stores or fwd.kv_loads:  # hierarchical cache copies, on this rank's heads
            run_copies(host_pool, kv_pool, fwd.kv_stores, fwd.kv_loads)
        if not fwd.input_ids:
            continue  # a keepalive
        runner.forward(to_batch(fwd, table.table, device))
        steps += 1
