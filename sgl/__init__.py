"""sgl: structured-generation programs on a RadixAttention engine.

`import sgl` mirrors `import sglang as sgl`: the DSL functions and backends are
re-exported here, each imported when first used (so `sgl.router` and `sgl.kv_events`
load no DSL, and DSL clients never load `sgl.Engine`, which needs torch).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = ("assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
        "get_server_info", "select", "set_default_backend", "system", "system_begin", "system_end", "user",
        "user_begin", "user_end")
_CHOICES = ("ChoicesDecision", "ChoicesSamplingMethod", "greedy_token_selection", "token_length_normalized",
            "unconditional_likelihood_normalized")

# name -> (module, attribute), imported on first use (PEP 562), so `import sgl.router` or
# `import sgl.kv_events` does not load the DSL, and the DSL does not load the engine.
_LAZY = {
    **{name: ("sgl.lang.api", name) for name in _API},
    **{name: ("sgl.lang.choices", name) for name in _CHOICES},
    "Backend": ("sgl.lang.backends.base", "Backend"),
    "BackendError": ("sgl.lang.backends.base", "BackendError"),
    "global_config": ("sgl.lang.global_config", "global_config"),
    "ProgramError": ("sgl.lang.interpreter", "ProgramError"),
    "SglFunction": ("sgl.lang.function", "SglFunction"),
    "ProgramState": ("sgl.lang.state", "ProgramState"),
    "ProgramStateGroup": ("sgl.lang.state", "ProgramStateGroup"),
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


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Backend", "BackendError", "ChoicesDecision", "ChoicesSamplingMethod", "Engine", "EngineBackend", "OpenAI",
    "ProgramError", "ProgramState", "ProgramStateGroup", "Runtime", "RuntimeEndpoint", "SglFunction", "assistant",
    "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string", "get_server_info",
    "global_config", "greedy_token_selection", "select", "set_default_backend", "system", "system_begin",
    "system_end", "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
]
