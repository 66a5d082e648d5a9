"""Rank 0's KV event stream: a `PageTracker` watching the scheduler's radix tree and the
publisher it feeds, once per scheduler iteration (the worker's serve loop calls `flush`).

Built only when `--kv-events-config` turns events on; otherwise the tree has no observer
and nothing here runs (zero cost).
"""

from __future__ import annotations

from typing import Any

from sgl.radix import RadixTree
from sgl.runtime.kv_events.config import KVEventsSettings
from sgl.runtime.kv_events.pages import PageTracker
from sgl.runtime.kv_events.publisher import ZmqEventPublisher


class KVEventStream:
    def __init__(self, settings: KVEventsSettings, tree: RadixTree, page_size: int,
                 data_parallel_rank: int | None = None, medium: str = "CPU") -> None:
        if tree.total_size():
            raise ValueError("KV events must be attached to an empty radix tree")
        self.page_size = page_size
        self.tracker = PageTracker(page_size, medium)
        self.publisher = ZmqEventPublisher(settings, data_parallel_rank)  # raises if the address is taken
        self.tree = tree
        tree.observer = self.tracker

    def flush(self) -> None:
        """Publish what the tree did since the last call as one batch (nothing if nothing)."""
        events = self.tracker.take_events()
        if events:
            self.publisher.publish(events)

    def info(self) -> dict[str, Any]:
        """What a router needs to subscribe (the `kv_events` entry of get_server_info)."""
        p = self.publisher
        return {"endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint, "topic": p.topic,
                "page_size": self.page_size, "data_parallel_rank": p.data_parallel_rank,
                "heartbeat_s": p.heartbeat_s, "dropped_batches": p.dropped}

    def close(self) -> None:
        self.tree.observer = None
        self.flush()
        self.publisher.close()
