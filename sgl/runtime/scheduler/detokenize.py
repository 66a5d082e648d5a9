"""Incremental detokenization: the text of a request's output ids at O(1) cost per token.

Decoding all output ids again on every token is O(n^2) in the output length. Instead each
step decodes a small window of ids starting at a point where the text so far ends on a
whole character, and keeps what the window adds:

    0 ............ prefix ............ read ................ len(ids)
    |-- committed --|-- last commit --|-- not committed yet --|
    committed text = decode(ids[:read])          (kept as chunks, joined on demand)
    prefix_text    = decode(ids[prefix:read])
    tail           = decode(ids[prefix:])[len(prefix_text):]
    text           = committed text + tail  ==  decode(ids)

The window starts one commit back (at `prefix`, not `read`) because decoders are not
purely concatenative at their first token (a SentencePiece decoder drops the leading
space of the first piece; a byte-level one may split a character there). A tail that
ends in U+FFFD (a partial UTF-8 sequence) is kept but not committed, so the next token
can complete the character. Where a window is not prefix-stable (a tokenizer that cleans
up spaces across tokens) it falls back to one full decode.

The committed text is a list of chunks so a step never copies the whole text: stop-string
checks read only `text_from(offset)`; `text()` joins (O(n)) only when a caller needs the
whole string (a stream output, the final output).

Ids can change behind us: jump-forward retokenizes the last sampled id together with the
forced text. The state keeps the ids its window decoded and can undo its last commit;
when the ids match neither, it starts again from zero (one full decode).
`tokenizers.decoders.DecodeStream` does the same windowing, but yields only completed
chunks (we need the partial tail too, to keep `decode(ids)` exactly) and takes the raw
Rust tokenizer rather than any object with `decode`.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to


class DecodeState:
    """One request's detokenization state (see the module docstring)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.chunks: list[str] = []  # committed text, in pieces
        self.committed_len = 0
        self.tail = ""
        self.prefix = 0
        self.read = 0
        self.prefix_text = ""
        self.window: list[int] = []  # ids[prefix:read] as they were when decoded
        # (prefix, read, prefix_text, window, length of the last commit): undoes it
        self.undo: tuple[int, int, str, list[int], int] | None = None

    def __len__(self) -> int:
        return self.committed_len + len(self.tail)

    def text(self) -> str:
        """The whole text, decode(ids) at the last `update` (O(n): joins the chunks)."""
        if len(self.chunks) > 1:
            self.chunks[:] = ["".join(self.chunks)]
        return (self.chunks[0] if self.chunks else "") + self.tail

    def text_from(self, start: int) -> str:
        """text()[start:], reading only the chunks it needs."""
        if start >= self.committed_len:
            return self.tail[start - self.committed_len :]
        out = [self.tail]
        end = self.committed_len
        for c in reversed(self.chunks):
            if end <= start:
                break
            begin = end - len(c)
            out.append(c[max(0, start - begin) :])
            end = begin
        return "".join(reversed(out))

    def update(self, tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> None:
        """Bring the state to decode(ids); `ids` extends (or rewrites the end of) the ids
        of the previous call on this request."""

        def dec(part: list[int]) -> str:
            return tokenizer.decode(part, skip_special_tokens=skip_special_tokens)

        if not self._matches(ids, self.prefix, self.read, self.window):
            u = self.undo
            if u is not None and self._matches(ids, u[0], u[1], u[3]):
                self._uncommit()
            else:
                self._reset()
        window_text = dec(ids[self.prefix :])
        if not window_text.startswith(self.prefix_text):  # not prefix-stable here: decode it all
            self._reset()
            window_text = dec(ids)
        self.tail = window_text[len(self.prefix_text) :]
        if self.tail and not self.tail.endswith(REPLACEMENT):  # ends on a whole character: commit
            self.undo = (self.prefix, self.read, self.prefix_text, self.window, len(self.tail))
            self.chunks.append(self.tail)
            self.committed_len += len(self.tail)
            self.tail = ""
            self.prefix, self.read = self.read, len(ids)
            self.window = ids[self.prefix : self.read]
            self.prefix_text = dec(self.window)

    @staticmethod
    def _matches(ids: list[int], prefix: int, read: int, window: list[int]) -> bool:
        return len(ids) >= read and ids[prefix:read] == window

    def _uncommit(self) -> None:
        assert self.undo is not None
        self.prefix, self.read, self.prefix_text, self.window, n = self.undo
        self.undo = None
        last = self.chunks.pop()  # the last commit, or everything when text() joined the chunks
        if len(last) > n:
            self.chunks.append(last[:-n])
        self.committed_len -= n
        self.tail = ""
