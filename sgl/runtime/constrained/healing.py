"""Token healing: back the prompt up over its last token(s), then make the first generated
token(s) spell what was removed, so the model tokenizes the prompt/output boundary as it
was trained (a prompt ending in "Answer: " no longer forces a bare-digit token where the
model wants " 24").

`plan_healing(ids, tok)` chooses the cut: it removes the last token, and keeps removing
earlier ones while the removed bytes stay a prefix of some vocabulary token (at most
MAX_HEAL_TOKENS), then one more while the cut would split a UTF-8 character. The removed
bytes are the *healing prefix*. `HealingGrammar(prefix, inner, tok)` is a Grammar whose
language is `prefix . L(inner)` (inner None: any text): while the prefix is not spelled
out, a token is allowed iff it is a prefix of what remains of it, or starts with all of
it and its overflow bytes are a viable start for `inner`; afterwards it delegates. A
token may therefore cover the prefix and continue into the constraint (" 24" after a
removed " " under an integer regex).

    prompt ids:  | kept ............................ | removed |
    output ids:                                      | healing token(s) | rest ...
    output text = decode(output ids) minus `text` (the prefix's whole characters)

The caller (the scheduler) prefills only the kept ids, so the radix cache holds the
backed-up prompt, and strips `HealPlan.text` from the output text.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from .base import GrammarError
from .vocab import TokenizerInfo

MAX_HEAL_TOKENS = 3  # most tokens removed because their joint text prefixes a token
_MAX_UTF8_EXTRA = 3  # most extra tokens removed to keep a character whole


@dataclass(frozen=True)
class HealPlan:
    """Where a prompt is cut: `kept` is prefilled; the output must start with `prefix`."""

    kept: list[int]
    num_removed: int
    prefix: bytes
    text: str  # the prefix's whole characters: what the output text starts with


class PrefixIndex:
    """The vocabulary's token byte strings, sorted, to find every token starting with a
    given byte string by bisection (one per TokenizerInfo, built on first use)."""

    def __init__(self, tok: TokenizerInfo) -> None:
        pairs = sorted((b, i) for i, b in enumerate(tok.token_bytes) if b)
        self.keys = [b for b, _ in pairs]
        self.ids = [i for _, i in pairs]
        self.by_bytes: dict[bytes, list[int]] = {}
        for b, i in pairs:
            self.by_bytes.setdefault(b, []).append(i)
        self._longer: dict[bytes, torch.Tensor] = {}

    @staticmethod
    def of(tok: TokenizerInfo) -> "PrefixIndex":
        return tok.memo("heal_prefix_index", lambda: PrefixIndex(tok))

    def span(self, prefix: bytes) -> tuple[int, int]:
        """[lo, hi) of the sorted keys that start with `prefix` (they are contiguous)."""
        lo = bisect.bisect_left(self.keys, prefix)
        upper = prefix.rstrip(b"\xff")  # the least byte string above every extension of prefix
        if not upper:
            return lo, len(self.keys)
        upper = upper[:-1] + bytes([upper[-1] + 1])
        return lo, bisect.bisect_left(self.keys, upper, lo)

    def longer_ids(self, prefix: bytes) -> torch.Tensor:
        """Ids of the tokens strictly longer than `prefix` that start with it (memoized:
        jump-forward asks for the same few tails, `"` and `":`, again and again)."""
        got = self._longer.get(prefix)
        if got is None:
            lo, hi = self.span(prefix)
            got = torch.as_tensor([self.ids[k] for k in range(lo, hi) if len(self.keys[k]) > len(prefix)],
                                  dtype=torch.long)
            if len(self._longer) < 4096:
                self._longer[prefix] = got
        return got

    def any_extends(self, prefix: bytes) -> bool:
        """True if some token is strictly longer than `prefix` and starts with it."""
        lo, hi = self.span(prefix)
        return any(len(self.keys[k]) > len(prefix) for k in range(lo, min(hi, lo + 2)))


def _is_continuation(b: int) -> bool:
    return (b & 0xC0) == 0x80


def _whole_chars(data: bytes) -> str:
    """The longest head of `data` that is valid UTF-8, decoded (a cut-off last char dropped)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="ignore")


def plan_healing(ids: list[int], tok: TokenizerInfo) -> HealPlan | None:
    """The cut for `ids` (see the module doc), or None where healing changes nothing: a
    prompt of one token, a special last token, or a last token no other token extends."""
    if len(ids) < 2:
        return None
    index = PrefixIndex.of(tok)
    k, prefix = 0, b""
    while k < MAX_HEAL_TOKENS and len(ids) - k > 1:
        b = tok.token_bytes[ids[-k - 1]] if 0 <= ids[-k - 1] < tok.vocab_size else None
        if not b:
            break
        cand = b + prefix
        lo, hi = index.span(cand)
        if k > 0 and lo == hi:
            break
        k, prefix = k + 1, cand
    extra = 0
    while prefix and _is_continuation(prefix[0]) and extra < _MAX_UTF8_EXTRA and len(ids) - k > 1:
        b = tok.token_bytes[ids[-k - 1]]
        if not b:
            break
        k, prefix, extra = k + 1, b + prefix, extra + 1
    if k == 0 or (prefix and _is_continuation(prefix[0])):
        return None
    if not index.any_extends(prefix):
        return None
    return HealPlan(kept=list(ids[:-k]), num_removed=k, prefix=prefix, text=_whole_chars(prefix))


def strip_healed(text: str, healed: str) -> str:
    """The output text a user sees: `text` (decode of the output ids) without the healed
    prefix; empty while the output has not spelled all of it yet."""
    if not healed:
        return text
    if text.startswith(healed):
        return text[len(healed):]
    return "" if healed.startswith(text.rstrip("\ufffd")) else text


def settle(grammar: Any) -> Any:
    """What a request should hold after a token: None once an unconstrained request's
    healing prefix is spelled (so it decodes unmasked from then on), else `grammar`."""
    if isinstance(grammar, HealingGrammar) and grammar.inner is None and grammar.healed:
        return None
    return grammar


class HealingGrammar:
    """`prefix . L(inner)` as a Grammar (base.py's protocol); inner None = any text."""

    def __init__(self, prefix: bytes, inner: Any, tok: TokenizerInfo) -> None:
        self.prefix = prefix
        self.inner = inner
        self.tok = tok
        self.pos = 0  # bytes of the prefix spelled so far
        self._stack: list[tuple[int, int]] = []  # per accepted token: (pos before, inner steps)
        self._mask_cache: dict[int, list[int]] = {}  # pos -> allowed ids (inner is at its start then)

    @property
    def healed(self) -> bool:
        return self.pos >= len(self.prefix)

    # -- masks ------------------------------------------------------------------------
    def _healing_ids(self) -> list[int]:
        got = self._mask_cache.get(self.pos)
        if got is not None:
            return got
        rest = self.prefix[self.pos:]
        index = PrefixIndex.of(self.tok)
        out: list[int] = []
        for j in range(1, len(rest) + 1):  # tokens that spell part (or all) of the rest
            out.extend(index.by_bytes.get(rest[:j], ()))
        lo, hi = index.span(rest)
        longer = [k for k in range(lo, hi) if len(index.keys[k]) > len(rest)]
        if self.inner is None:
            out.extend(index.ids[k] for k in longer)
        else:
            first_ok: dict[int, bool] = {}
            for k in longer:
                over = index.keys[k][len(rest):]
                ok = first_ok.get(over[0])
                if ok is None:
                    ok = first_ok[over[0]] = self._inner_allows(over[:1])
                if ok and (len(over) == 1 or self._inner_allows(over)):
                    out.append(index.ids[k])
        self._mask_cache[self.pos] = out
        return out

    def _inner_allows(self, data: bytes) -> bool:
        try:
            self.inner.accept_bytes(data)
        except GrammarError:
            return False
        self.inner.rollback(1)
        return True

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        if self.healed:
            if self.inner is not None:
                self.inner.fill_mask(mask_row)
            else:
                mask_row[: self.tok.vocab_size] = True
            return
        ids = self._healing_ids()
        if ids:
            mask_row[torch.as_tensor(ids, dtype=torch.long)] = True

    def allowed_token_ids(self) -> list[int]:
        row = torch.zeros(self.tok.vocab_size, dtype=torch.bool)
        self.fill_mask(row)
        return torch.nonzero(row).flatten().tolist()

    # -- stepping ---------------------------------------------------------------------
    def accept_token(self, token_id: int) -> None:
        if self.healed:
            if self.inner is not None:
                self.inner.accept_token(token_id)
            self._stack.append((self.pos, 1 if self.inner is not None else 0))
            return
        b = self.tok.token_bytes[token_id] if 0 <= token_id < self.tok.vocab_size else None
        if not b:
            raise GrammarError(f"token healing: token {token_id} does not spell the prompt's removed text")
        rest = self.prefix[self.pos:]
        if rest.startswith(b):
            self._stack.append((self.pos, 0))
            self.pos += len(b)
            return
        if not b.startswith(rest):
            raise GrammarError(f"token healing: token {token_id} ({b!r}) does not start with {rest!r}")
        over = b[len(rest):]
        steps = 0
        if over and self.inner is not None:
            self.inner.accept_bytes(over)  # GrammarError if the constraint refuses it
            steps = 1
        self._stack.append((self.pos, steps))
        self.pos = len(self.prefix)

    def accept_bytes(self, data: bytes) -> None:
        """Advance by raw bytes (one rollback step)."""
        rest = self.prefix[self.pos:]
        if not rest:
            if self.inner is not None:
                self.inner.accept_bytes(data)
            self._stack.append((self.pos, 1 if self.inner is not None else 0))
            return
        if rest.startswith(data):
            self._stack.append((self.pos, 0))
            self.pos += len(data)
            return
        if not data.startswith(rest):
            raise GrammarError(f"token healing: text does not start with {rest!r}")
        over = data[len(rest):]
        steps = 0
        if over and self.inner is not None:
            self.inner.accept_bytes(over)
            steps = 1
        self._stack.append((self.pos, steps))
        self.pos = len(self.prefix)

    def rollback(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            pos, steps = self._stack.pop()
            if steps and self.inner is not None:
                self.inner.rollback(steps)
            self.pos = pos

    def is_terminated(self) -> bool:
        return self.healed and self.inner is not None and self.inner.is_terminated()

    def can_end(self) -> bool:
        return self.healed and (self.inner is None or self.inner.can_end())

    def jump_forward_string(self) -> str | None:
        # Never force the prefix itself: that would retokenize it as the prompt had it.
        if not self.healed or self.inner is None:
            return None
        return self.inner.jump_forward_string()

    def copy(self) -> "HealingGrammar":
        return HealingGrammar(self.prefix, None if self.inner is None else self.inner.copy(), self.tok)


# -- the jump-forward boundary ---------------------------------------------------------
#
# Jump-forward appends our own tokenization of the text a grammar forces. Its last token
# may be one the model would have extended: forced `{"answer"` ends in `"`, where the model
# writes `":` as one token. Forcing `"` puts the model off its own tokenization (the same
# harm as a prompt ending in a space). So, as at the prompt boundary, the tail is held
# back: the forced tokens are appended short of it, and the grammar's own mask (which
# allows only tokens that start with the rest of the forced text) lets the model spell it
# with the token it prefers.
#
#     retokenized ids: | head (sampled) | forced ........ | held back |
#                                       ^ appended now     ^ sampled next, under the mask

def jump_forward_holdback(ids: list[int], num_head: int, tok: TokenizerInfo) -> tuple[int, bytes]:
    """(cut, held bytes) for jump-forward's retokenized `ids`, whose first `num_head` are
    the sampled token(s) being retokenized: ids[cut:] spell `held`, a byte string some
    longer vocabulary token starts with (at most MAX_HEAL_TOKENS tokens, never into the
    head, never starting inside a UTF-8 character). cut == len(ids) holds nothing back."""
    index = PrefixIndex.of(tok)
    cut, held = len(ids), b""
    while cut > num_head and len(ids) - cut < MAX_HEAL_TOKENS:
        t = ids[cut - 1]
        b = tok.token_bytes[t] if 0 <= t < tok.vocab_size else None
        if not b:
            break
        cand = b + held
        if held and index.span(cand)[0] == index.span(cand)[1]:
            break
        cut, held = cut - 1, cand
    if not held or _is_continuation(held[0]) or not index.any_extends(held):
        return len(ids), b""
    return cut, held


def grammar_extends(grammar: Any, held: bytes, tok: TokenizerInfo) -> bool:
    """Does `grammar`, at its current state, allow some token strictly longer than `held`
    that starts with it? (If not, holding `held` back gains nothing: force it.) The mask
    computed here is the one the next step needs, so backends that cache masks per state
    pay for it once."""
    longer = PrefixIndex.of(tok).longer_ids(held)
    if not len(longer):
        return False
    row = torch.zeros(tok.vocab_size, dtype=torch.bool)
    try:
        grammar.fill_mask(row)
    except (IndexError, RuntimeError, ValueError):  # a backend that wants the model's width: hold back
        return True
    return bool(row[longer].any())
