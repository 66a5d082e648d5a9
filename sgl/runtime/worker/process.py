"""Entry point of one worker process (one tensor-parallel rank):
`python -m sgl.runtime.worker.process SPEC_JSON` (ipc/messages.py WorkerSpec).

Started by the API process for the ranks on its machine, or by `launch_server` on the
other nodes. It ignores SIGINT (Ctrl-C in a terminal reaches the whole process group;
the API process decides how to stop; SIGTERM likewise), joins the process group when tp > 1, builds its
shard, and then serves (rank 0) or follows. A failure before serving is reported to the
API process as `Crashed` (rank 0) and always as a non-zero exit.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys

import torch

from sgl.runtime.config import EngineConfig, torchrun_values
from sgl.runtime.distributed.parallel import TPInfo
from sgl.runtime.ipc.messages import Crashed, Ready, WorkerSpec, decode_spec
from sgl.runtime.memory.kv_pool import KVPool
from sgl.runtime.worker.build import RankModel

log = logging.getLogger("sgl.worker")


def threads_per_rank(cfg: EngineConfig) -> int:
    if cfg.num_threads:
        return cfg.num_threads
    local_ranks = max(1, cfg.tp_size // cfg.nnodes)
    return max(1, (os.cpu_count() or 1) // local_ranks)


def main(spec: WorkerSpec) -> int:
    from sgl.runtime.worker.build import build_kv_events, build_rank, build_scheduler, request_table

    cfg = EngineConfig.from_kwargs(**spec.config)
    torch.set_num_threads(threads_per_rank(cfg))
    serve = None
    if spec.rank == 0:
        from sgl.runtime.worker.serve import Serve

        serve = Serve(None, spec.in_addr, spec.out_addr, spec.parent_pid)
    try:
        tp, peers = TPInfo(), None
        if cfg.tp_size > 1:
            from sgl.runtime.distributed.group import init_tp_group
            from sgl.runtime.distributed.peers import PlanBroadcast
            from sgl.runtime.worker.build import resolve_device

            device = resolve_device(cfg)
            if device != "cpu":
                # Not built yet: ranks are not pinned to their own GPUs (every rank would load
                # onto GPU 0) and the pool sizing reads host memory. Refused, not half-run.
                raise ValueError(f"--tp-size {cfg.tp_size} runs on CPU ranks only (--device cpu); on GPUs "
                                 "start one worker per GPU with --tp-size 1 behind the router")
            tp, plan_group = init_tp_group(spec.rank, cfg.tp_size, spec.dist_init_method, cfg.dist_timeout, device)
            peers = PlanBroadcast(plan_group, keepalive_s=min(10.0, cfg.dist_timeout / 4))
        rm = build_rank(cfg, spec.hf_dir, tp)
        sizes = _gather_pool_sizes(rm, tp)
        if spec.rank != 0:
            from sgl.runtime.worker.follower import run_follower

            assert peers is not None
            return run_follower(rm.runner, request_table(cfg, rm), peers, rm.device, rm.host_pool, rm.pool)
        assert serve is not None
        serve.scheduler = build_scheduler(cfg, rm, peers)
        serve.peers = peers
        serve.kv_events = build_kv_events(cfg, serve.scheduler, rm.device)
        serve.send_now(Ready(
            max_total_tokens=rm.max_total_tokens, dtype=str(next(rm.model.parameters()).dtype).replace("torch.", ""),
            device=rm.device, tp_size=cfg.tp_size, nnodes=cfg.nnodes,
            kv_pool_tokens_per_rank=[s[0] for s in sizes], kv_pool_bytes_per_rank=[s[1] for s in sizes],
            weight_bytes_per_rank=[s[2] for s in sizes], pids=[s[3] for s in sizes]))
    except Exception as e:
        log.exception("rank %d failed to start", spec.rank)
        if serve is not None:
            serve.send_now(Crashed(f"rank {spec.rank} failed to start: {type(e).__name__}: {e}"))
            serve.close_kv_events()
            serve.ctx.destroy(linger=5000)
        return 1
    return serve.run()


def _gather_pool_sizes(rm: RankModel, tp: TPInfo) -> list[tuple[int, int, int, int]]:
    """(KV slots, KV bytes, weight bytes, pid) of every rank, in rank order."""
    p = rm.pool
    mine = (p.num_slots - 1, p.num_slots * KVPool.bytes_per_token(p.num_layers, p.num_kv_heads, p.head_dim, p.dtype),
            sum(w.numel() * w.element_size() for w in rm.model.parameters()), os.getpid())
    if tp.size == 1:
        return [mine]
    import torch.distributed as dist

    out: list = [None] * tp.size
    dist.all_gather_object(out, mine)
    return out


def init_method(cfg: EngineConfig) -> str:
    """How ranks rendezvous: torchrun's own store when launched by it, else tcp://ADDR."""
    if torchrun_values() and cfg.dist_init_addr == torchrun_values()["dist_init_addr"]:
        return "env://"
    return f"tcp://{cfg.dist_init_addr}"


if __name__ == "__main__":
    # Ctrl-C reaches the whole terminal process group and systemd's default stop sends
    # SIGTERM to every process of the service: the API process decides when its workers
    # stop (after in-flight requests had their grace period); a worker whose API process
    # is gone stops by itself (serve.py), and stop_all() kills with SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.enable(all_threads=True)
    the_spec = decode_spec(sys.argv[1])
    logging.basicConfig(level=the_spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank{the_spec.rank} %(name)s: %(message)s")
    sys.exit(main(the_spec))
