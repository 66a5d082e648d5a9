"""Exact regexes for bounded integers and decimals.

Integers: a range [lo, hi] of non-negative integers is split into runs of equal digit
count and spelled digit by digit (the classic range-to-regex construction); negative
values are the mirrored magnitude range behind a '-'. Numbers with bounds are spelled
without an exponent (sound: every matched text is in range; `1e-05` style spellings of
in-range values are not produced) as integer part + fraction, where the fraction at the
boundary integer is compared digit by digit against the bound's fraction.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Optional

from ._regex import INTEGER, NUMBER, NEVER, Frag, alt, group

_D = "[0-9]"


def _digit(lo: int, hi: int) -> str:
    if lo == hi:
        return str(lo)
    return "[%d-%d]" % (lo, hi)


def _same_len(lo: str, hi: str) -> list[str]:
    """Regex pieces for all digit strings d with lo <= d <= hi, len(lo)==len(hi)."""
    if not lo:
        return [""]
    if lo[0] == hi[0]:
        return [lo[0] + p for p in _same_len(lo[1:], hi[1:])]
    n = len(lo) - 1
    out = []
    rest_lo_min = lo[1:] == "0" * n
    rest_hi_max = hi[1:] == "9" * n
    a, b = int(lo[0]), int(hi[0])
    if not rest_lo_min:
        out += [lo[0] + p for p in _same_len(lo[1:], "9" * n)]
        a += 1
    if not rest_hi_max:
        b -= 1
    if a <= b:
        out.append(_digit(a, b) + (_D + "{%d}" % n if n > 1 else _D if n == 1 else ""))
    if not rest_hi_max:
        out += [hi[0] + p for p in _same_len("0" * n, hi[1:])]
    return out


def nonneg_int_range(lo: int, hi: Optional[int]) -> Frag:
    """Canonical spellings (no leading zeros) of integers in [lo, hi], lo >= 0."""
    if hi is not None and hi < lo:
        return NEVER
    pieces: list[str] = []
    if lo == 0:
        pieces.append("0")
        lo = 1
        if hi == 0:
            return "0"
    width = len(str(lo))
    while True:
        top = 10**width - 1
        end = top if hi is None else min(hi, top)
        if hi is None and lo == 10 ** (width - 1):
            pieces.append("[1-9]" + _D + "{%d,}" % (width - 1) if width > 1 else "[1-9]" + _D + "*")
            break
        pieces += _same_len(str(lo), str(end))
        if hi is not None and end == hi:
            break
        lo = end + 1
        width += 1
    return alt(pieces)


def int_range(lo: Optional[int], hi: Optional[int]) -> Frag:
    """Integers in [lo, hi] (either side may be open) in canonical JSON spelling."""
    if lo is None and hi is None:
        return INTEGER
    if lo is not None and hi is not None and lo > hi:
        return NEVER
    parts: list[Frag] = []
    if hi is None or hi >= 0:
        parts.append(nonneg_int_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        mag_lo = 1 if hi is None or hi >= 0 else -hi
        mag_hi = None if lo is None else -lo
        neg = nonneg_int_range(mag_lo, mag_hi)
        if neg is not None:
            parts.append("-" + group(neg))
    return alt(parts)


# ----- fractions: digit strings compared as 0.<digits>, missing digits read as 0 -----
# Each builder returns the regex of *non-empty* digit strings after the '.'; whether the
# bare integer (fraction zero) qualifies is decided separately by `_zero_ok`.

def _frac_ge(alpha: str, strict: bool, top: bool = True) -> Frag:
    """Digit strings s with 0.s >= 0.alpha (> if strict); empty allowed unless top."""
    if alpha.strip("0") == "":
        if strict:
            return _D + "*[1-9]" + _D + "*"
        return _D + ("+" if top else "*")
    c, rest = int(alpha[0]), alpha[1:]
    parts: list[Frag] = []
    if c < 9:
        parts.append(_digit(c + 1, 9) + _D + "*")
    tail = _frac_ge(rest, strict, top=False)
    if tail is not None:
        parts.append(str(c) + tail)
    return alt(parts)


def _frac_le(beta: str, strict: bool, top: bool = True) -> Frag:
    """Digit strings s with 0.s <= 0.beta (< if strict); empty allowed unless top."""
    if beta.strip("0") == "":
        return NEVER if strict else ("0+" if top else "0*")
    c, rest = int(beta[0]), beta[1:]
    parts: list[Frag] = [] if top else [""]
    if c > 0:
        parts.append(_digit(0, c - 1) + _D + "*")
    tail = _frac_le(rest, strict, top=False)
    if tail is not None:
        parts.append(str(c) + tail)
    return alt(parts)


def _frac_between(alpha: str, a_strict: bool, beta: str, b_strict: bool) -> Frag:
    n = max(len(alpha), len(beta), 1)
    alpha, beta = alpha.ljust(n, "0"), beta.ljust(n, "0")
    if alpha == beta:
        if a_strict or b_strict:
            return NEVER
        return alpha.rstrip("0") + "0*" if alpha.strip("0") else "0+"
    i = 0
    while alpha[i] == beta[i]:
        i += 1
    prefix, a, b = alpha[:i], int(alpha[i]), int(beta[i])
    parts: list[Frag] = []
    lo_tail = _frac_ge(alpha[i + 1:], a_strict, top=False)
    if lo_tail is not None:
        parts.append(str(a) + lo_tail)
    if a + 1 <= b - 1:
        parts.append(_digit(a + 1, b - 1) + _D + "*")
    hi_tail = _frac_le(beta[i + 1:], b_strict, top=False)
    if hi_tail is not None:
        parts.append(str(b) + hi_tail)
    body = alt(parts)
    out: list[Frag] = [NEVER if body is None else prefix + body]
    # Fractions that stop inside the shared prefix equal alpha when alpha's remaining
    # digits are zeros (0.5 vs alpha 0.50): allowed only on an inclusive lower bound.
    k0 = max(1, len(alpha.rstrip("0")))
    if not a_strict and k0 <= len(prefix):
        extra = len(prefix) - k0
        out.append(prefix[:k0] + ("0{0,%d}" % extra if extra else ""))
    return alt(out)


def _with_fraction(int_part: str, frac: Frag, zero_ok: bool) -> Frag:
    """`int_part`, then '.digits' from `frac`; the bare integer only if `zero_ok`."""
    if frac is None:
        return int_part if zero_ok else NEVER
    if zero_ok:
        return int_part + r"(?:\." + group(frac) + ")?"
    return int_part + r"\." + group(frac)


def _split(d: Decimal) -> tuple[int, str]:
    s = format(d, "f")
    if "." in s:
        ip, fp = s.split(".")
    else:
        ip, fp = s, ""
    return int(ip), fp.rstrip("0")


def _magnitude(a: Decimal, a_strict: bool, b: Optional[Decimal], b_strict: bool) -> Frag:
    """Decimal spellings (no sign, no exponent) of x with a <= x <= b, a >= 0."""
    A, alpha = _split(a)
    if b is not None:
        B, beta = _split(b)
        if A == B:
            zero_ok = alpha == "" and not a_strict and (beta != "" or not b_strict)
            return _with_fraction(str(A), _frac_between(alpha, a_strict, beta, b_strict),
                                  zero_ok)
    parts: list[Frag] = [
        _with_fraction(str(A), _frac_ge(alpha, a_strict), alpha == "" and not a_strict)
    ]
    mid = nonneg_int_range(A + 1, None if b is None else B - 1)
    if mid is not None:
        parts.append(group(mid) + r"(?:\.[0-9]+)?")
    if b is not None:
        parts.append(_with_fraction(str(B), _frac_le(beta, b_strict), beta != "" or not b_strict))
    return alt(parts)


def number_range(lo: Optional[Decimal], lo_strict: bool, hi: Optional[Decimal],
                 hi_strict: bool) -> Frag:
    """JSON numbers x with lo <= x <= hi (strict flags make a side exclusive)."""
    if lo is None and hi is None:
        return NUMBER
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_strict or hi_strict))):
        return NEVER
    zero = Decimal(0)
    if lo == zero and not lo_strict and hi is None:
        # The common "minimum: 0": every unsigned spelling, exponents included.
        return r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
    parts: list[Frag] = []
    if hi is None or hi > zero or (hi == zero and not hi_strict):
        if lo is None or lo < zero:
            a, a_strict = zero, False
        else:
            a, a_strict = lo, lo_strict
        parts.append(_magnitude(a, a_strict, hi, hi_strict))
    if lo is None or lo < zero:
        # Negative side: magnitudes in (0 or -hi, -lo]; '-0' is never produced.
        if hi is None or hi >= zero:
            m_lo, m_lo_strict = zero, True
        else:
            m_lo, m_lo_strict = -hi, hi_strict
        m = _magnitude(m_lo, m_lo_strict, None if lo is None else -lo, lo_strict)
        if m is not None:
            parts.append("-" + group(m))
    return alt(parts)
