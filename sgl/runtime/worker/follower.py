"""The loop of a tensor-parallel rank other than 0: run every step rank 0 broadcasts.

Each `Forward` (ipc/messages.py) first replays rank 0's writes to the request -> token
table on this rank's copy, then runs the same ForwardBatch through this rank's shard; the
model's collectives pair with rank 0's. Sampling, grammars and the scheduler exist only
on rank 0. The loop ends on a stop message, or with an error when rank 0 is gone.
"""

from __future__ import annotations

import logging
from typing import Any

from sgl.runtime.distributed.peers import PlanBroadcast
from sgl.runtime.executor.step import to_batch

log = logging.getLogger("sgl.worker")


def run_follower(runner: Any, table: Any, peers: PlanBroadcast, device: str) -> int:
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
        if not fwd.input_ids:
            continue  # a keepalive
        runner.forward(to_batch(fwd, table.table, device))
        steps += 1
