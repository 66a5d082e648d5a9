"""sgl: structured-generation programs on a RadixAttention engine.

`import sgl` mirrors `import sglang as sgl`: the DSL functions and backends are
re-exported here, and `sgl.Engine` (the offline engine, which needs torch) is
imported only when first used, so DSL clients stay light.
"""

from __future__ import annotations

from typing import Any

from sgl.lang.api import (assistant, assistant_begin, assistant_end, flush_cache, function, gen, gen_int, gen_string,
                          get_server_info, select, set_default_backend, system, system_begin, system_end, user,
                          user_begin, user_end)
from sgl.lang.backends.base import Backend, BackendError
from sgl.lang.choices import (ChoicesDecision, ChoicesSamplingMethod, greedy_token_selection, token_length_normalized,
                              unconditional_likelihood_normalized)
from sgl.lang.global_config import global_config
from sgl.lang.interpreter import ProgramError
from sgl.lang.function import SglFunction
from sgl.lang.state import ProgramState, ProgramStateGroup

__version__ = "0.1.0"

_LAZY = {
    "Engine": ("sgl.runtime.engine", "Engine"),
    "Runtime": ("sgl.lang.backends.runtime", "Runtime"),
    "RuntimeEndpoint": ("sgl.lang.backends.http", "RuntimeEndpoint"),
    "OpenAI": ("sgl.lang.backends.openai", "OpenAI"),
    "EngineBackend": ("sgl.lang.backends.engine", "EngineBackend"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sgl' has no attribute {name!r}")


__all__ = [
    "Backend", "BackendError", "ChoicesDecision", "ChoicesSamplingMethod", "Engine", "EngineBackend", "OpenAI",
    "ProgramError", "ProgramState", "ProgramStateGroup", "Runtime", "RuntimeEndpoint", "SglFunction", "assistant",
    "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string", "get_server_info",
    "global_config", "greedy_token_selection", "select", "set_default_backend", "system", "system_begin",
    "system_end", "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
]
