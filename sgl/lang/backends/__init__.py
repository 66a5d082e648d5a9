"""DSL backends: the protocol (base.py) and its implementations, imported lazily.

`as_backend` turns what a user passes (`sgl.Engine`, `Runtime`, a backend) into a
Backend, so `sgl.set_default_backend(sgl.Engine())` works like SGLang's Runtime.
"""

from __future__ import annotations

import threading
from typing import Any

from sgl.lang.backends.base import Backend, BackendError

_wrapped: dict[int, Backend] = {}
_lock = threading.Lock()


def as_backend(obj: Any) -> Backend:
    if isinstance(obj, Backend):
        return obj
    endpoint = getattr(obj, "endpoint", None)
    if isinstance(endpoint, Backend):  # sgl.Runtime
        return endpoint
    if hasattr(obj, "generate") and hasattr(obj, "tokenizer"):  # an in-process sgl.Engine
        from sgl.lang.backends.engine import EngineBackend

        with _lock:
            b = _wrapped.get(id(obj))
            if b is None or b.engine is not obj:  # type: ignore[attr-defined]
                b = _wrapped[id(obj)] = EngineBackend(obj)
            return b
    raise TypeError(f"{type(obj).__name__} is not an sgl backend; pass sgl.Engine(...), sgl.Runtime(...), "
                    "sgl.RuntimeEndpoint(url) or sgl.OpenAI(model)")


__all__ = ["Backend", "BackendError", "as_backend"]
