"""Grammar-constrained decoding: protocol, backends, registry, caches, masks.

The scheduler needs only `compile_grammar` / `GrammarCompiler` (registry), the `Grammar`
protocol (base) and `apply_masks` (masks); users and benchmarks use `GrammarMatcher`.
Backends (outlines-core, lark) are imported lazily by the registry.
"""

from __future__ import annotations

from .base import Grammar, GrammarError
from .masks import allocate_masks, apply_masks, fill_masks
from .matcher import GrammarMatcher
from .registry import KINDS, GrammarCompiler, compile_grammar
from .vocab import TokenizerInfo

__all__ = ["Grammar", "GrammarError", "GrammarMatcher", "GrammarCompiler", "KINDS", "TokenizerInfo",
           "allocate_masks", "apply_masks", "compile_grammar", "fill_masks"]
