"""FakeBackend: a deterministic, model-free backend for testing DSL programs.

Every character is one token (id = its code point), so token counts and logprob
positions are easy to predict. What a gen returns comes from `responder(prompt,
sampling_params)` (default "ok"), then stop strings and max_new_tokens apply like a
real engine; prompt logprobs come from `scorer(text_before, char)`. It records every
call in `.calls` and counts prompt characters served from a simulated prefix cache, so
tests can check that forks and batches warm and reuse the cache.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Callable, Iterator

from sgl.lang.backends.base import Backend
from sgl.lang.chat_template import CHATML_TEMPLATE, ChatTemplate

Responder = Callable[[str, dict], "str | list[str]"]
Scorer = Callable[[str, str], float]


def _default_scorer(before: str, ch: str) -> float:
    return -((ord(ch) * 7 + len(before)) % 11) / 10.0 - 0.05


class FakeBackend(Backend):
    def __init__(self, responder: Responder | None = None, scorer: Scorer | None = None,
                 chat_template: ChatTemplate | None = None, fail_on: str | None = None,
                 stream_chunk: int = 2):
        self.responder = responder or (lambda prompt, sp: "ok")
        self.scorer = scorer or _default_scorer
        self.chat_template = chat_template or CHATML_TEMPLATE
        self.fail_on = fail_on  # a prompt containing this string gets an abort result
        self.stream_chunk = stream_chunk
        self.calls: list[dict] = []
        self._cache: set[str] = set()
        self._lock = threading.Lock()
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def _cached_len(self, text: str) -> int:
        best = 0
        for t in self._cache:
            n = 0
            for a, b in zip(t, text):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def _one(self, prompt: str, sp: dict, return_logprob: bool, start: int | None, k: int = 0) -> dict:
        with self._lock:
            self.calls.append({"prompt": prompt, "sampling_params": dict(sp), "return_logprob": return_logprob,
                               "logprob_start_len": start})
            cached = self._cached_len(prompt)
            self._cache.add(prompt)
            self.prompt_tokens_total += len(prompt)
            self.cached_tokens_total += cached
        if self.fail_on is not None and self.fail_on in prompt:
            return {"text": "", "output_ids": [], "meta_info": {
                "finish_reason": {"type": "abort", "message": f"fake failure on {self.fail_on!r}"},
                "prompt_tokens": len(prompt), "completion_tokens": 0, "cached_tokens": cached}}
        max_new = sp.get("max_new_tokens", 128)
        text = ""
        reason: dict[str, Any] = {"type": "length", "length": max_new}
        if max_new > 0:
            out = self.responder(prompt, sp)
            text = out[k % len(out)] if isinstance(out, list) else out
            reason = {"type": "stop", "matched": 2}
            cut = len(text)
            for s in sp.get("stop") or []:
                i = text.find(s)
                if 0 <= i < cut:
                    cut, reason = i, {"type": "stop", "matched": s}
            for pat in sp.get("stop_regex") or []:
                m = re.search(pat, text)
                if m and m.start() < cut:
                    cut, reason = m.start(), {"type": "stop", "matched": m.group(0)}
            text = text[:cut]
            if len(text) > max_new:
                text, reason = text[:max_new], {"type": "length", "length": max_new}
        meta: dict[str, Any] = {"id": f"fake-{len(self.calls)}", "finish_reason": reason,
                                "prompt_tokens": len(prompt), "completion_tokens": len(text),
                                "cached_tokens": cached}
        if return_logprob:
            s0 = start or 0
            meta["input_token_logprobs"] = [
                (None if p == 0 else self.scorer(prompt[:p], prompt[p]), ord(prompt[p]), None)
                for p in range(s0, len(prompt))]
            meta["output_token_logprobs"] = [(self.scorer(prompt + text[:i], c), ord(c), None)
                                             for i, c in enumerate(text)]
        return {"text": text, "output_ids": [ord(c) for c in text], "meta_info": meta}

    def generate(self, prompt=None, sampling_params=None, *, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, return_text_in_logprobs=False):
        if input_ids is not None:
            prompt = ["".join(map(chr, ids)) for ids in input_ids] if input_ids and isinstance(input_ids[0], list) \
                else "".join(map(chr, input_ids))
        many = isinstance(prompt, list)
        prompts = prompt if many else [prompt]
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(prompts)
        starts = logprob_start_len if isinstance(logprob_start_len, list) else [logprob_start_len] * len(prompts)
        out = []
        for p, sp, st in zip(prompts, sps, starts):
            n = sp.get("n", 1)
            res = [self._one(p, sp, return_logprob, st, k) for k in range(n)]
            if return_text_in_logprobs:
                for r in res:
                    for key in ("input_token_logprobs", "output_token_logprobs"):
                        if key in r["meta_info"]:
                            r["meta_info"][key] = [(a, b, chr(b)) for a, b, _ in r["meta_info"][key]]
            out.extend(res) if (many or n > 1) else out.append(res[0])
        return out if (many or len(out) > 1) else out[0]

    def generate_stream(self, prompt: str, sampling_params: dict, **opts: Any) -> Iterator[dict]:
        final = self.generate(prompt, sampling_params, **opts)
        assert isinstance(final, dict)
        text = final["text"]
        for i in range(self.stream_chunk, len(text), self.stream_chunk):
            yield {"text": text[:i], "output_ids": final["output_ids"][:i],
                   "meta_info": {**final["meta_info"], "finish_reason": None}}
        yield final

    def flush_cache(self) -> bool:
        with self._lock:
            self._cache.clear()
        return True

    def get_server_info(self) -> dict:
        total = self.prompt_tokens_total
        return {"prompt_tokens_total": total, "cached_tokens_total": self.cached_tokens_total,
                "cache_hit_rate": self.cached_tokens_total / total if total else 0.0}
