"""Conversion state shared by the per-type builders: options, the root document for
`$ref` lookups, the current JSON pointer, the recursion stack, the strict/relaxed
policy for keywords we cannot enforce, and (machine mode) the sub-machine table."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sgl.runtime.constrained.base import GrammarError

if TYPE_CHECKING:
    from .machines import Machines

# Bounded counting is what makes outlines-core's DFA explode (its unanchored start
# state tracks every possible restart). Bounds above this are "cannot enforce".
MAX_COUNT = 64
# minLength/maxLength of a plain string: counted with CANON_COUNTED_CHAR (~15 DFA
# states per count, ~0.6 s of DFA build at 1024), so the bound can be much higher.
MAX_STRING_COUNT = 1024


@dataclass(frozen=True)
class Limits:
    """How much counting the backend a conversion is for affords. Whole-DFA backends
    (numpy, outlines) pay for every DFA state at compile, so counts stay small and long
    strings are counted in small block machines; the native engine builds only the
    states a text visits, so a count costs NFA states (~20 per counted character), and
    big blocks keep returns (a token crossing a block's end) rare."""

    string_count: int = MAX_STRING_COUNT  # a plain string counted inline up to this
    block: int = 32                       # characters per block machine past it
    item_count: int = MAX_COUNT           # minItems / maxItems enforced up to this
    # A counted string past this is a machine of its own (one per distinct bound, shared
    # by every property that has it) rather than ~20 NFA states per count inline in
    # each; None: always inline.
    call_count: int | None = None


WHOLE_DFA = Limits()
LAZY_DFA = Limits(string_count=4096, block=1024, item_count=4096, call_count=64)
# How many times one $ref may be open on the expansion stack (recursive schemas) in
# single-regex mode; machine mode calls the $ref's machine instead (no bound).
MAX_REF_DEPTH = 2
# Past this much regex text the DFA is too big to build within the compile budget
# (MaskBench sample: 60-100k chars build in ~1-6 s; 100-150k in ~3-12 s).
MAX_REGEX_CHARS = 100_000
# Nesting depth of values left unconstrained by the schema ({} / true) in single-regex
# mode; machine mode calls a recursive any-value machine instead (no bound).
ANY_VALUE_DEPTH = 1


class UnsupportedSchemaError(GrammarError):
    """A JSON Schema keyword (or value) the converter cannot enforce exactly."""

    def __init__(self, keyword: str, pointer: str, detail: str = "") -> None:
        self.keyword = keyword
        self.pointer = pointer or "/"
        msg = f"JSON Schema keyword {keyword!r} at {self.pointer} cannot be enforced"
        super().__init__(msg + (f": {detail}" if detail else ""))


@dataclass
class Context:
    root: Any
    ws: str = ""
    strict: bool = True
    ref_stack: list[str] = field(default_factory=list)
    path: list[str] = field(default_factory=list)
    # Machine mode (see machines.py) when set; None = everything inlined in one regex.
    machines: "Machines | None" = None
    limits: Limits = WHOLE_DFA

    @property
    def pointer(self) -> str:
        return "/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in self.path)

    def unsupported(self, keyword: str, detail: str = "") -> None:
        """Raise in strict mode; in relaxed mode warn and let the caller drop it."""
        err = UnsupportedSchemaError(keyword, self.pointer, detail)
        if self.strict:
            raise err
        warnings.warn(f"{err} (ignored in relaxed mode)", stacklevel=3)
