"""DSL backends: the protocol (base.py) and its implementations, imported lazily.

`as_backend` turns what a user passes (`sgl.Engine`, `Runtime`, a backend) into a
Backend, so `sgl.set_default_backend(sgl.Engine())` works like SGLang's Runtime.
"""

from __future__ import annotations

import threading
from typing import Any

from sgl.lang.backends.base import Backend, BackendError

_lock = threading.Lock()
_ATTR = "_sgl_lang_backend"  # one wrapper per Engine, kept on it: it goes when the Engine goes


def as_backend(obj: Any) -> Backend:
    if isinstance(obj, Backend):
        return obj
    endpoint = getattr(obj, "endpoint", None)
    if isinstance(endpoint, Backend):  # sgl.Runtime
        return endpoint
    if hasattr(obj, "generate") and hasattr(obj, "tokenizer"):  # an in-process sgl.Engine
        from sgl.lang.backends.engine import EngineBackend

        with _lock:
            b = getattr(obj, _ATTR, None)
            if b is None:
                b = EngineBackend(obj)
                try:
                    setattr(obj, _ATTR, b)
                except AttributeError:  # an object that takes no attributes: a wrapper per call
                    pass
            return b
    raise TypeError(f"{type(obj).__name__} is not an sgl backend; pass sgl.Engine(...), sgl.Runtime(...), "
                    "sgl.RuntimeEndpoint(url) or sgl.OpenAI(model)")


__all__ = ["Backend", "BackendError", "as_backend"]
