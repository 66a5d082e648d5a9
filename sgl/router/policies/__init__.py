"""Routing policies behind one protocol (`base.Policy`); `make_policy(name, options)` picks one.

The registry maps a policy name to "module:Class" and imports it only when asked, so the
router loads ZMQ and the KV index only for `kv_aware`. A new policy is one file plus one
line here.
"""

from __future__ import annotations

import importlib

from sgl.router.policies.base import Policy, RouteRequest, WorkerState
from sgl.router.policies.options import PolicyOptions

_REGISTRY: dict[str, str] = {
    "round_robin": "sgl.router.policies.simple:RoundRobinPolicy",
    "random": "sgl.router.policies.simple:RandomPolicy",
    "power_of_two": "sgl.router.policies.power_of_two:PowerOfTwoPolicy",
    "cache_aware": "sgl.router.policies.cache_aware:CacheAwarePolicy",
    "kv_aware": "sgl.router.policies.kv_aware:KvAwarePolicy",
}

POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def make_policy(name: str, options: PolicyOptions | None = None) -> Policy:
    """A fresh, not yet started policy. Raises ValueError naming the choices for an unknown name."""
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    module, cls = target.split(":")
    policy: Policy = getattr(importlib.import_module(module), cls)(options or PolicyOptions())
    return policy


__all__ = ["POLICY_NAMES", "Policy", "PolicyOptions", "RouteRequest", "WorkerState", "make_policy"]
