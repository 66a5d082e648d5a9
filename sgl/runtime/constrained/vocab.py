"""Vocabulary adapter: what every grammar backend needs to know about a tokenizer.

Grammars work on bytes, tokenizers on strings in their own private encodings (GPT-2
byte-level BPE spells byte 0x20 as `Ġ`; SentencePiece spells a space `▁` and stores raw
bytes as `<0xNN>`). `TokenizerInfo` is the plain result of undoing that once: the exact
bytes each token id adds to the text (None for special tokens, which no grammar may
emit), the EOS ids, and a stable hash used in compile-cache keys. It is built from a
Hugging Face tokenizer (fast or `tokenizers.Tokenizer`) or straight from a GGUF file,
and converts to an outlines-core `Vocabulary` and to numpy byte tables on demand.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable, Iterable

import numpy as np

from .. import config

BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"
RAW = "raw"


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte->printable-char table.

    Printable latin-1 bytes stand for themselves; the other 68 bytes are shifted to
    code points 256.. in byte order, which is how `Ġ` (U+0120) comes to mean 0x20.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table: dict[str, int] = {chr(b): b for b in keep}
    shift = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shift)] = b
            shift += 1
    return table


def byte_level_to_bytes(token: str) -> bytes | None:
    """Decode one GPT-2 byte-level token; None if it uses chars outside the table."""
    table = _unicode_to_byte()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return None


def sentencepiece_to_bytes(token: str) -> bytes:
    """Decode one SentencePiece token: `<0xNN>` is a raw byte, `▁` is a space."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace("\u2581", " ").encode("utf-8")


@dataclass(frozen=True, eq=False)
class TokenizerInfo:
    """Plain description of a vocabulary as bytes.

    `vocab_size` is the number of token ids (max id + 1); the logits row may be wider
    (lm_head padding), masks leave the extra columns False. `token_bytes[i]` is None for
    special/control tokens and for ids with no token.
    """

    vocab_size: int
    token_bytes: tuple[bytes | None, ...]
    eos_token_ids: tuple[int, ...]
    kind: str = BYTE_LEVEL
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ValueError("TokenizerInfo needs at least one EOS token id")
        if len(self.token_bytes) != self.vocab_size:
            raise ValueError("token_bytes must have exactly vocab_size entries")

    # -- identity -------------------------------------------------------------------
    @property
    def hash(self) -> str:
        """Stable content hash (hex) of kind, EOS ids and every token's bytes."""
        h = self._memo.get("hash")
        if h is None:
            d = hashlib.sha256()
            d.update(f"{self.kind}|{self.vocab_size}|{list(self.eos_token_ids)}|".encode())
            for b in self.token_bytes:
                if b is None:
                    d.update(b"\x00N")
                else:
                    d.update(len(b).to_bytes(2, "little") + b)
            h = self._memo["hash"] = d.hexdigest()[:32]
        return h

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenizerInfo) and other.hash == self.hash

    def __hash__(self) -> int:
        return hash(self.hash)

    def __getstate__(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "token_bytes": self.token_bytes,
                "eos_token_ids": self.eos_token_ids, "kind": self.kind}

    def __setstate__(self, st: dict[str, Any]) -> None:
        for k, v in st.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "_memo", {})

    # -- derived tables (memoized; the object itself stays immutable) ---------------
    def to_outlines_vocabulary(self) -> Any:
        """outlines-core Vocabulary over the usable tokens (EOS handled by the caller)."""
        v = self._memo.get("outlines")
        if v is None:
            from outlines_core import Vocabulary

            eos = set(self.eos_token_ids)
            by_bytes: dict[bytes, list[int]] = {}
            for i, b in enumerate(self.token_bytes):
                if b and i not in eos:
                    by_bytes.setdefault(b, []).append(i)
            v = self._memo["outlines"] = Vocabulary(self.eos_token_ids[0], by_bytes)
        return v

    def byte_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, lengths, bytes) of usable tokens sorted by length, longest first.

        `bytes` is uint8 [n, max_len] zero-padded. Sorting lets a vectorized walk shrink
        its working set to a prefix as positions run past short tokens.
        """
        t = self._memo.get("byte_table")
        if t is None:
            eos = set(self.eos_token_ids)
            items = [(i, b) for i, b in enumerate(self.token_bytes) if b and i not in eos]
            items.sort(key=lambda x: -len(x[1]))
            n = len(items)
            width = len(items[0][1]) if items else 1
            mat = np.zeros((n, width), dtype=np.uint8)
            lens = np.zeros(n, dtype=np.int64)
            for r, (_, b) in enumerate(items):
                mat[r, : len(b)] = np.frombuffer(b, dtype=np.uint8)
                lens[r] = len(b)
            ids = np.array([i for i, _ in items], dtype=np.int64)
            t = self._memo["byte_table"] = (ids, lens, mat)
        return t

    def memo(self, name: str, build: Callable[[], Any]) -> Any:
        """One derived table per tokenizer (walkers, tries, indexes): `build()` on first use."""
        if name not in self._memo:
            self._memo[name] = build()
        return self._memo[name]

    def decode(self, ids: Iterable[int]) -> bytes:
        """Concatenated bytes of non-special ids (special ones contribute nothing)."""
        return b"".join(self.token_bytes[i] or b"" for i in ids)

    # -- constructors ---------------------------------------------------------------
    @staticmethod
    def from_tokens(tokens: list[str | None], *, kind: str, special_ids: Iterable[int],
                    eos_token_ids: Iterable[int], literal: dict[int, str] | None = None
                    ) -> "TokenizerInfo":
        """Build from token strings in the tokenizer's own spelling.

        `literal` maps ids whose text is plain (non-special added tokens) to that text.
        """
        special = set(special_ids)
        literal = literal or {}
        out: list[bytes | None] = []
        for i, tok in enumerate(tokens):
            if tok is None or i in special:
                out.append(None)
            elif i in literal:
                out.append(literal[i].encode("utf-8"))
            elif kind == BYTE_LEVEL:
                out.append(byte_level_to_bytes(tok))
            elif kind == SENTENCEPIECE:
                out.append(sentencepiece_to_bytes(tok))
            else:
                out.append(tok.encode("utf-8"))
        eos = tuple(dict.fromkeys(int(e) for e in eos_token_ids))
        return TokenizerInfo(len(out), tuple(out), eos, kind)

    @staticmethod
    def from_hf_tokenizer(tokenizer: Any, *, eos_token_ids: Iterable[int] | None = None
                          ) -> "TokenizerInfo":
        """From a transformers fast tokenizer or a bare `tokenizers.Tokenizer`."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        spec = json.loads(backend.to_str())
        kind = _detect_kind(spec)
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
        size = max(vocab.values()) + 1
        tokens: list[str | None] = [None] * size
        for s, i in vocab.items():
            tokens[i] = s
        special: set[int] = set()
        literal: dict[int, str] = {}
        for at in spec.get("added_tokens") or []:
            if at.get("special", True):
                special.add(int(at["id"]))
            else:
                literal[int(at["id"])] = at["content"]
        special.update(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
        eos = list(eos_token_ids or [])
        tid = getattr(tokenizer, "eos_token_id", None)
        if tid is not None and not eos:
            eos = [tid]
        if not eos:
            raise ValueError("tokenizer has no eos_token_id; pass eos_token_ids=")
        return TokenizerInfo.from_tokens(tokens, kind=kind, special_ids=special,
                                         eos_token_ids=eos, literal=literal)

    @staticmethod
    def from_gguf(path: str) -> "TokenizerInfo":
        """Straight from a GGUF file's tokenizer.ggml.* fields (no transformers)."""
        from gguf import GGUFReader

        r = GGUFReader(path)

        def arr(name: str) -> list[Any]:
            f = r.fields[name]
            return [f.parts[i] for i in f.data]

        tokens = [bytes(p).decode("utf-8", errors="replace") for p in arr("tokenizer.ggml.tokens")]
        types = [int(p[0]) for p in arr("tokenizer.ggml.token_type")]
        model = bytes(r.fields["tokenizer.ggml.model"].parts[-1]).decode()
        eos = int(r.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
        # GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
        special = [i for i, t in enumerate(types) if t in (2, 3, 5)]
        kind = BYTE_LEVEL if model == "gpt2" else SENTENCEPIECE if model == "llama" else RAW
        literal = {i: tokens[i] for i, t in enumerate(types) if t == 4}
        return TokenizerInfo.from_tokens(tokens, kind=kind, special_ids=special,
                                         eos_token_ids=[eos], literal=literal)


def _detect_kind(spec: dict[str, Any]) -> str:
    """Which private spelling a tokenizer.json uses, judged by its decoder/pre-tokenizer."""
    text = json.dumps({k: spec.get(k) for k in ("decoder", "pre_tokenizer")})
    if '"ByteLevel"' in text:
        return BYTE_LEVEL
    if "ByteFallback" in text or "\u2581" in text or "\\u2581" in text or "Metaspace" in text:
        return SENTENCEPIECE
    model = spec.get("model") or {}
    if model.get("byte_fallback"):
        return SENTENCEPIECE
    return RAW


def cached_gguf_tokenizer_info(path: str, cache_dir: str | None = None) -> TokenizerInfo:
    """`TokenizerInfo.from_gguf`, memoized on disk (reading GGUF strings takes seconds)."""
    import os
    import pickle

    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    p = config.cache_dir(cache_dir) / "grammars" / f"tokinfo-{key}.pkl"
    try:
        with open(p, "rb") as f:
            info = pickle.load(f)
        if isinstance(info, TokenizerInfo):
            return info
    except Exception:
        pass
    info = TokenizerInfo.from_gguf(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(info, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, p)
    except OSError:
        pass
    return info


def greedy_encode(tok: TokenizerInfo, data: bytes | str) -> list[int]:
    """Longest-match tokenization over token bytes (a valid, not canonical, split).

    Grammars must accept any split of an allowed text, so tests and benchmarks use this
    to turn texts into token ids without the real tokenizer.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    table = tok._memo.get("greedy")
    if table is None:
        eos = set(tok.eos_token_ids)
        table = {}
        for i, b in enumerate(tok.token_bytes):
            if b and i not in eos:
                table.setdefault(b, i)
        tok._memo["greedy"] = table
    longest = max(map(len, table)) if table else 1
    out: list[int] = []
    pos = 0
    while pos < len(data):
        for n in range(min(longest, len(data) - pos), 0, -1):
            tid = table.get(data[pos:pos + n])
            if tid is not None:
                out.append(tid)
                pos += n
                break
        else:
            raise ValueError(f"no token covers byte {data[pos]:#x} at {pos}")
    return out
