"""Keys of additional object members: a JSON string whose decoded value is none of the
declared property names, spelled as a trie complement over decoded characters.

Spelled as (paths ending at a non-name trie node) | (paths leaving the trie) + one
shared "rest of string" tail: outlines-core does not minimize its DFA, so a tail copied
per trie node would multiply the states it has to index. When every name is printable
ASCII without `"` or `\\`, a character outside that set leaves the trie from any node;
it is spelled once after a copy of the trie, so its multi-byte UTF-8 and escape
spellings cost DFA states once instead of once per trie node.

A trie node's three regexes depend only on the name suffixes below it, so they are
memoized by that suffix set: objects declaring the same or overlapping name lists
(Kubernetes, tool configs with one block per rule) share whole subtries.
"""

from __future__ import annotations

from ._regex import ANY_CHAR, MAX_CODEPOINT, Frag, alt, group
from .charsets import complement, encode_literal, encode_set, intersect
from .memo import Table, memo

# Characters that never label a trie edge when every name is plain: exits from every node.
_WIDE = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, MAX_CODEPOINT)]

_KEYS = Table(1 << 22)  # sorted distinct names -> key regex
_NODES = Table(1 << 22)  # (suffixes below a node, plain) -> (ends, exits, prefixes)


def key_not_in(names: list[str]) -> str:
    """A JSON string (with quotes) whose decoded value is none of `names`."""
    suffixes = tuple(sorted(set(names)))
    out = _KEYS.get(suffixes)
    if out is not None:
        return out
    plain = all(0x20 <= ord(ch) <= 0x7E and ch not in '"\\' for n in suffixes for ch in n)
    ends, exits, prefixes = _walk(suffixes, plain)
    tail = ANY_CHAR + "*"
    parts = [ends, None if exits is None else exits + tail]
    if plain:
        parts.append(group(prefixes or "") + encode_set(_WIDE) + tail)
    body = alt(parts)
    out = '"' + (body or "") + '"'
    return _KEYS.put(suffixes, out, _chars(suffixes) + len(out))


def _walk(suffixes: tuple[str, ...], plain: bool) -> tuple[Frag, Frag, Frag]:
    """(ends, exits, prefixes) of the trie node below which the names continue with
    `suffixes` (sorted, distinct; "" when a name ends at the node): paths that end
    at a non-name node, paths that leave the trie, and paths to any node."""
    key = (suffixes, plain)
    out = _NODES.get(key)
    if out is not None:
        return out
    # Sorted suffixes group by first character in ascending order, each group sorted.
    kids: dict[str, list[str]] = {}
    for s in suffixes:
        if s:
            kids.setdefault(s[0], []).append(s[1:])
    ends: list[Frag] = [] if suffixes and suffixes[0] == "" else [""]
    exits: list[Frag] = [_exit_set((tuple(kids), plain))]
    prefixes: list[Frag] = [""]
    for k, rest in kids.items():
        e, x, p = _walk(tuple(rest), plain)
        lit = encode_literal(k)
        ends.append(None if e is None else lit + e)
        exits.append(None if x is None else lit + x)
        prefixes.append(lit + (p or ""))
    out = (alt(ends), alt(exits), alt(prefixes))
    return _NODES.put(key, out, _chars(suffixes) + _chars(out))


@memo(1 << 21, lambda key, out: len(key[0]) + len(out or ""))
def _exit_set(key: tuple[tuple[str, ...], bool]) -> Frag:
    """One character leaving a trie node whose edges are `kids` (printable ASCII only
    when `plain`: the wide characters leave from the shared tail instead)."""
    kids, plain = key
    narrow = [(0x20, 0x7E)] if plain else [(0, MAX_CODEPOINT)]
    return encode_set(intersect(narrow, complement([(ord(k), ord(k)) for k in kids])))


def _chars(texts: tuple[Frag, ...]) -> int:
    return sum(len(t) for t in texts if t is not None)


def disjoint_bodies(bodies: list[str]) -> bool:
    """Whether no key matches two of these key-body regexes (each pair's DFA product is
    empty). False when it cannot tell (no C compiler, syntax the native parser leaves
    out, a DFA past its size limit): callers then keep their conservative spelling."""
    from ..base import GrammarError
    from ..dfa_ops import intersect
    from ..native_dfa import build

    try:
        dfas = [build(b) for b in bodies]
    except GrammarError:
        return False
    if any(d is None for d in dfas):
        return False
    for i, a in enumerate(dfas):
        for b in dfas[i + 1:]:
            try:
                intersect([a, b])  # type: ignore[list-item]
            except GrammarError:
                continue  # "matches nothing": this pair is disjoint
            return False
    return True
