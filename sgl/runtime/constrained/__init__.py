"""Grammar-constrained decoding: protocol, backends, registry, caches, masks.

The scheduler needs only `compile_grammar` / `GrammarCompiler` (registry), the `Grammar`
protocol (base) and `apply_masks` (masks); users and benchmarks use `GrammarMatcher`.
Backends (outlines-core, lark) are imported lazily by the registry. The names below are
resolved on first use too, so that `constrained.kinds` (the constraint kinds, read by the
torch-free DSL) can be imported without pulling in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Grammar": "base", "GrammarError": "base", "GrammarMatcher": "matcher", "GrammarCompiler": "registry",
    "KINDS": "registry", "TokenizerInfo": "vocab", "allocate_masks": "masks", "apply_masks": "masks",
    "compile_grammar": "registry", "fill_masks": "masks",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
