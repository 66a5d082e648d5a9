"""Sub-machines: the converter's way out of one giant regex.

In machine mode the converter emits a root regex plus a list of sub-machine regexes.
A regex may contain *call markers* (`call_marker(i)`, a reserved code point) meaning
"one value of machine i appears here"; the pushdown backend (constrained/pushdown*.py)
turns each marker into a call edge of a byte DFA. A subschema becomes its own machine
when it is recursive (a `$ref` met again while it is being converted), a free-form
value (any JSON value at any depth: one self-calling machine), or when its regex text
grows past `SPLIT_CHARS`; machines are memoized by regex text, so a `$ref` used fifty
times is built once. A machine may also be an `Intersect` of several regexes (a value
must match all of them, e.g. a string with both a pattern and a format): its DFA is the
product of the parts' DFAs (constrained/dfa_ops.py), so the converter never has to
spell an intersection as one regex. Small subschemas stay inline, so a schema with none
of the above converts to exactly the regex of single-regex mode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

from ._regex import (BOOLEAN, NULL, NUMBER, RESERVED_BASE, RESERVED_COUNT, STRING, Frag,
                     call_marker, group)

# Markers as call_marker spells them; text never spells these code points otherwise
# (literal() refuses them) except as the bounds of the excluded range in negated
# classes, which the look-arounds skip.
_MARKER = re.compile(r"(?<!-)\\U(0010f[0-9a-f]{3})(?!-\\U)")
# The same without the look-behind, which makes a search ~10x slower over a 100k-char
# text; `_markers` checks the character before instead.
_MARKER_AHEAD = re.compile(r"\\U(0010f[0-9a-f]{3})(?!-\\U)")

# A subschema regex longer than this becomes a machine of its own. Small enough that
# every DFA builds in well under a second; large enough that typical schemas (and all
# that fit one regex today without free-form values) stay a single machine.
SPLIT_CHARS = 6000
# Members, items or branches shorter than this are never worth a call.
MIN_EXTRACT_CHARS = 48
# Past this much regex text in all, every plain string value becomes a call of one
# shared string machine: each inline copy costs ~15 DFA states (escapes, UTF-8), so
# large schemas build in about half the time; string tokens then come from one
# cached frame, and only the few tokens that close a string mid-token are walked on.
SHARE_STRINGS_CHARS = 60_000


@dataclass(frozen=True)
class Intersect:
    """A sub-machine whose language is the intersection of the parts' languages. Each
    part is a full JSON value regex (e.g. '"' + body + '"'); parts may call machines."""

    parts: tuple[str, ...]


Sub = Union[str, Intersect, None]


def sub_texts(sub: Sub) -> tuple[str, ...]:
    """The regex texts a sub-machine is made of (its parts, for an Intersect)."""
    if sub is None:
        return ()
    return sub.parts if isinstance(sub, Intersect) else (sub,)


@dataclass
class MachineSpec:
    """Conversion result: machine 0 is the root; `call_marker(i)` calls `subs[i]`.

    A sub-machine is a regex, an `Intersect` of regexes, or None (it matches nothing;
    calls to it are dead).
    """

    root: str
    subs: list[Sub] = field(default_factory=list)


class Machines:
    """Sub-machines collected during one conversion (ids in creation order)."""

    def __init__(self, ws: str) -> None:
        self.ws = ws
        self.regexes: list[Sub] = []
        self._by_text: dict[str, int] = {}
        self._by_parts: dict[tuple[str, ...], int] = {}
        self.ref_ids: dict[str, int] = {}  # recursive $refs: id reserved before the regex
        self.ref_memo: dict[str, Frag] = {}
        self._any: str | None = None

    def reserve(self) -> int:
        if len(self.regexes) >= RESERVED_COUNT - 1:  # the last code point: dfa_build's end marker
            raise OverflowError(f"more than {RESERVED_COUNT - 1} sub-machines")
        self.regexes.append(None)
        return len(self.regexes) - 1

    def define(self, mid: int, regex: Frag) -> None:
        self.regexes[mid] = regex
        if regex is not None:
            self._by_text.setdefault(regex, mid)

    def call(self, regex: str) -> str:
        """The marker calling a machine for `regex` (one machine per distinct text)."""
        mid = self._by_text.get(regex)
        if mid is None:
            mid = self.reserve()
            self.define(mid, regex)
        return call_marker(mid)

    def intersect(self, parts: list[str]) -> str:
        """The marker calling a machine whose language is the intersection of `parts`
        (each a full JSON value regex); one machine per distinct (sorted, deduplicated)
        part list. A single part is an ordinary call."""
        key = tuple(sorted(set(parts)))
        if not key:
            raise ValueError("intersect: no parts")
        if len(key) == 1:
            return self.call(key[0])
        mid = self._by_parts.get(key)
        if mid is None:
            mid = self.reserve()
            self.regexes[mid] = Intersect(key)
            self._by_parts[key] = mid
        return call_marker(mid)

    def any_value(self) -> str:
        """The marker of the free-form machine: any JSON value, nested to any depth."""
        if self._any is None:
            mid = self.reserve()
            self._any = v = call_marker(mid)
            ws, comma = self.ws, self.ws + "," + self.ws
            arr = r"\[" + ws + group(v + group(comma + v) + "*") + "?" + ws + r"\]"
            member = STRING + ws + ":" + ws + v
            obj = r"\{" + ws + group(member + group(comma + member) + "*") + "?" + ws + r"\}"
            self.define(mid, group("|".join([STRING, NUMBER, BOOLEAN, NULL, arr, obj])))
        return self._any

    def spec(self, root: str) -> MachineSpec:
        """The machines reachable from `root` (size-driven attempts may leave unused
        ones behind; those become None and are never built)."""
        spec = self._reachable(root)
        size = len(spec.root) + sum(len(t) for r in spec.subs for t in sub_texts(r))
        if spec.subs and size > SHARE_STRINGS_CHARS:
            call = self.call(STRING)
            # Intersect parts keep their own strings: a product needs them inline.
            self.regexes = [r if r is None or r == STRING or isinstance(r, Intersect)
                            else _share(r, call) for r in self.regexes]
            spec = self._reachable(_share(root, call))
        return spec

    def _reachable(self, root: str) -> MachineSpec:
        seen: set[int] = set()
        todo = [root]
        while todo:
            for hx in _markers(todo.pop()):
                mid = int(hx, 16) - RESERVED_BASE
                if mid not in seen and mid < len(self.regexes):
                    seen.add(mid)
                    todo.extend(sub_texts(self.regexes[mid]))
        return MachineSpec(root, [r if i in seen else None for i, r in enumerate(self.regexes)])


def _markers(text: str) -> list[str]:
    """`_MARKER.findall(text)`: the hex code points of the call markers, in order."""
    return [m.group(1) for m in _MARKER_AHEAD.finditer(text)
            if text[m.start() - 1:m.start()] != "-"]


def _share(regex: str, call: str) -> str:
    """`regex` with every standalone occurrence of STRING replaced by `call` (same
    language): not right after an escaping backslash, not before a quantifier."""
    out, i, n = [], 0, len(STRING)
    while True:
        j = regex.find(STRING, i)
        if j < 0:
            out.append(regex[i:])
            return "".join(out)
        k = j
        while k > 0 and regex[k - 1] == "\\":
            k -= 1
        after = regex[j + n:j + n + 1]
        if (j - k) % 2 == 0 and after not in ("*", "+", "?", "{"):
            out.append(regex[i:j] + call)
        else:
            out.append(regex[i:j + n])
        i = j + n


def shrink(parts: Sequence[Frag], build: Callable[[list[Frag]], Frag],
           machines: Machines | None, limit: int = SPLIT_CHARS) -> Frag:
    """`build(parts)`, with the longest parts turned into calls while the result is
    longer than `limit` (parts can be copied several times by `build`). Lowers the
    length a part must have to be called, halving, until the result fits or no part
    is left worth a call."""
    out = build(list(parts))
    if machines is None or out is None or len(out) <= limit:
        return out
    cut = limit // 2
    cur = list(parts)
    while cut >= MIN_EXTRACT_CHARS:
        cur = [machines.call(p) if p is not None and len(p) > cut else p for p in cur]
        out = build(cur)
        if out is None or len(out) <= limit:
            return out
        cut //= 2
    return out
