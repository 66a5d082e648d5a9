"""Rank 0 tells the other tensor-parallel ranks what to run: one `Forward` message per
step (ipc/messages.py), broadcast over gloo as a length then the msgpack bytes.

The other ranks block in `recv` between steps. A collective waits at most dist_timeout,
so an idle rank 0 sends an empty Forward (a keepalive) every `keepalive_s`. Any failure
of a broadcast means a rank is gone and the group can never run another step together:
it is raised as FatalExecutorError, which stops rank 0's scheduler.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from sgl.runtime.executor.plan import FatalExecutorError
from sgl.runtime.ipc.messages import Forward, decode_forward, encode


class PlanBroadcast:
    def __init__(self, group: Any, keepalive_s: float) -> None:
        self.group = group
        self.keepalive_s = keepalive_s
        self._size = torch.zeros(1, dtype=torch.int64)
        self._last_send = time.monotonic()

    def send(self, fwd: Forward) -> None:
        data = encode(fwd)
        try:
            self._size[0] = len(data)
            dist.broadcast(self._size, 0, group=self.group)
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.group)
        except Exception as e:
            raise FatalExecutorError(f"a tensor-parallel rank is gone (plan broadcast failed: {e})") from e
        self._last_send = time.monotonic()

    def recv(self) -> Forward:
        dist.broadcast(self._size, 0, group=self.group)
        buf = torch.empty(int(self._size[0]), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.group)
        return decode_forward(buf.numpy().tobytes())

    def keepalive(self) -> None:
        """Call every iteration: sends an empty step if nothing was sent for keepalive_s
        (requests waiting on a grammar compile run no step for a while)."""
        if time.monotonic() - self._last_send > self.keepalive_s:
            self.send(Forward())

    def stop(self) -> None:
        """Tell the other ranks to exit (best effort: they may be gone already)."""
        try:
            self.send(Forward(stop=True))
        except FatalExecutorError:
            pass
