"""Joining the tensor-parallel process group (torch.distributed: gloo on CPUs, NCCL on
CUDA), with errors that name the address and the timeout when a rank never comes.

The plan broadcast (distributed/peers.py) always runs over gloo, on the CPU: with NCCL
the default group carries the model's collectives and a second, gloo group the plans.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from sgl.runtime.distributed.parallel import TPInfo


def init_tp_group(rank: int, world_size: int, init_method: str, timeout_s: float,
                  device: str) -> tuple[TPInfo, Any]:
    """Join as `rank` of `world_size`; returns (this rank's TPInfo, the gloo group for plans)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # a rendezvous timeout or refused connection: say where and how long
        raise RuntimeError(
            f"rank {rank} of {world_size} could not form the process group at {init_method} within "
            f"{timeout_s:g}s (--dist-timeout); check that every node was started with the same "
            f"--dist-init-addr, --nnodes and --tp-size and can reach that address: {e}") from e
    plan_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return TPInfo(rank=rank, size=world_size), plan_group


def leave_tp_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone: nothing left to tidy
            pass
