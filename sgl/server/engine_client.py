"""The server's one door into the engine: validation, budgets, aborts, metrics.

Handlers describe a generation as a `GenInput` (plain data); this module checks what the
engine would otherwise reject late or crash on (sampling params, prompt and budget
against the context length, token ids against the vocabulary, regex and JSON Schema
syntax), calls `engine.async_generate`, and guarantees that every request it started is
aborted if the client disconnects or the server shuts down. Every finished generation is
counted in the metrics. Errors come out as `APIError` (4xx with a message naming the
field); engine `ValueError`s (including `GrammarError`) and abort finish reasons map to
400 as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from sgl.runtime.constrained.kinds import CONSTRAINT_KINDS
from sgl.runtime.engine import SchedulerCrashedError
from sgl.runtime.engine_io import sample_rid
from sgl.runtime.lru import LRU
from sgl.runtime.sampling_params import ALIASES, SamplingParams, regex_problem
from sgl.server.errors import APIError, ClientDisconnected, bad_request
from sgl.server.metrics import Metrics
from sgl.server.pd import engine_kwargs
from sgl.server.sse import await_or_disconnect, guarded_stream, merge_streams

logger = logging.getLogger("sgl.server")

# SGLang sampling keys that change nothing here; accepted and dropped so SGLang clients work.
_IGNORED_SAMPLING_KEYS = ("stream_interval", "custom_params")
_MAX_TOP_LOGPROBS = 64
_SEED_MOD = 2**63
TOO_LONG = 2**62  # token count standing for "longer than any context"


def new_rid(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex


@dataclass
class GenInput:
    """One prompt's generation request, as the engine wants it."""

    text: str | None
    input_ids: list[int] | None
    sampling: dict[str, Any]
    rid: str
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    num_prompt_tokens: int = 0
    bootstrap: list[Any] | None = None  # PD: one disaggregation Bootstrap per sample (n of them)


@dataclass
class StreamHandle:
    """An open engine stream whose first chunk has already arrived."""

    first: dict[str, Any]
    it: Any
    rid: str
    t0: float
    ttft: float
    client: "EngineClient"
    closed: bool = field(default=False)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        last = self.first
        yield self.first
        if finish_of(self.first) is None:
            try:
                async for chunk in self.it:
                    last = chunk
                    yield chunk
            except SchedulerCrashedError as e:  # mid-stream: the handlers send it as an error event
                raise APIError(str(e), 503) from e
        self.closed = True
        self.client.active.pop(self.rid, None)
        self.client.metrics.observe_generation(last.get("meta_info") or {}, time.perf_counter() - self.t0, self.ttft)

    def close(self) -> None:
        """Abort in the engine unless finished; safe to call many times."""
        self.client.active.pop(self.rid, None)
        if not self.closed:
            self.closed = True
            self.client.abort(self.rid)


def tagged_chunks(handles: list[StreamHandle]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """The chunks of several streams as they arrive, each with its stream's index."""
    if len(handles) == 1:
        return ((0, c) async for c in handles[0].chunks())
    return merge_streams([h.chunks() for h in handles])


def sse_response(frames: AsyncIterator[bytes], handles: list[StreamHandle]) -> StreamingResponse:
    """An SSE response of `frames` that closes (so aborts) the streams however it ends."""

    def close_all() -> None:
        for h in handles:
            h.close()

    return StreamingResponse(guarded_stream(frames, close_all, [h.it for h in handles]),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def meta_of(chunk: dict[str, Any]) -> dict[str, Any]:
    return chunk.get("meta_info") or {}


def finish_of(chunk: dict[str, Any]) -> dict[str, Any] | None:
    fr = meta_of(chunk).get("finish_reason", chunk.get("finish_reason"))
    return fr if fr else None


def abort_error(message: str, status: int = 400) -> APIError:
    """The error for an engine abort: a 400 (grammar compile failures name their
    constraint field), or the status the worker gave (a PD transfer failure is a 5xx)."""
    if status != 400:
        return APIError(message, status)
    m = re.match(r"invalid (regex|json_schema|ebnf|lark|choices)\b", message)
    return bad_request(message, m.group(1) if m else None)


def abort_message(chunk: dict[str, Any]) -> str | None:
    fr = finish_of(chunk)
    if isinstance(fr, dict) and fr.get("type") == "abort":
        return str(fr.get("message") or "request aborted")
    return None


def abort_status(chunk: dict[str, Any]) -> int:
    """The HTTP status of an aborted chunk: 400 unless the worker named one."""
    fr = finish_of(chunk)
    status = fr.get("status_code") if isinstance(fr, dict) else None
    return status if isinstance(status, int) and 400 <= status < 600 else 400


def abort_chunk_error(chunk: dict[str, Any]) -> APIError | None:
    msg = abort_message(chunk)
    return None if msg is None else abort_error(msg, abort_status(chunk))


def split_n(g: GenInput) -> list[GenInput]:
    """One engine stream per sample, seeds offset so that seeded samples differ."""
    n = int(g.sampling.get("n", 1))
    if n == 1:
        return [g]
    out = []
    for j in range(n):
        sp = dict(g.sampling, n=1)
        if sp.get("seed") is not None:
            sp["seed"] = sp["seed"] + j
        out.append(GenInput(g.text, g.input_ids, sp, sample_rid(g.rid, j), g.return_logprob, g.logprob_start_len,
                            g.top_logprobs_num, g.num_prompt_tokens,
                            None if g.bootstrap is None else [g.bootstrap[j]]))
    return out


def client_of(request: Request) -> "EngineClient":
    return request.app.state.client


class EngineClient:
    """Wraps one engine for the HTTP layer; see the module docstring."""

    def __init__(self, engine: Any, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.active: dict[str, float] = {}
        self.tokenizer = engine.tokenizer
        self.vocab_size = len(self.tokenizer)
        self.context_length = int(getattr(engine, "context_length", None) or 2048)
        # A request's prompt + output must also fit the KV pool (which may be smaller than the
        # context window): the default output budget is what fits both.
        pool = getattr(engine, "max_total_tokens", None)
        self.max_sequence = min(self.context_length, int(pool)) if isinstance(pool, int) else self.context_length
        # No token decodes to more than this many characters (byte-level BPE strings are at
        # least as long as their text), so longer texts exceed the context without tokenizing.
        self.max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=64) + 1
        self._token_texts: LRU[int, str] = LRU(65536)  # logprob rendering decodes the same ids often

    # ---- validation -------------------------------------------------------------------

    def clean_sampling(self, d: Any, param: str = "sampling_params") -> dict[str, Any]:
        """Validate a sampling-params dict (SGLang names); return the dict to send on."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise bad_request(f"{param} must be an object, got {type(d).__name__}", param)
        d = {k: v for k, v in d.items() if v is not None and k not in _IGNORED_SAMPLING_KEYS}
        if d.get("logit_bias"):
            raise bad_request("logit_bias is not supported", _sub(param, "logit_bias"))
        d.pop("logit_bias", None)
        if isinstance(d.get("json_schema"), dict):
            d["json_schema"] = json.dumps(d["json_schema"])
        try:
            sp = SamplingParams.from_dict(d)
        except (ValueError, TypeError) as e:
            raise bad_request(f"{param}: {e}" if param else str(e), param or None) from None
        for alias, name in ALIASES.items():
            if alias in d:
                d.setdefault(name, d.pop(alias))
        if sp.seed is not None:
            d["seed"] = sp.seed % _SEED_MOD  # any int is a fine seed; keep it in int64 range
        if sp.top_k > self.vocab_size:
            d["top_k"] = -1  # same distribution, and no out-of-range topk in the sampler
        bad_ids = [t for t in sp.stop_token_ids if t >= self.vocab_size]
        if bad_ids:
            raise bad_request(f"{_sub(param, 'stop_token_ids')}: ids {bad_ids[:5]} are outside the vocabulary "
                              f"(size {self.vocab_size})", _sub(param, "stop_token_ids"))
        if sp.regex is not None:
            check_regex(sp.regex, _sub(param, "regex"))
        if sp.json_schema is not None:
            check_json_schema(sp.json_schema, _sub(param, "json_schema"))
        for k in CONSTRAINT_KINDS:  # a blank spec of any string kind is a client mistake
            spec = getattr(sp, k)
            if isinstance(spec, str) and not spec.strip():
                raise bad_request(f"{_sub(param, k)} must not be empty", _sub(param, k))
        return d

    def count_tokens(self, text: str) -> int:
        if len(text) > self.max_token_chars * self.context_length:
            return TOO_LONG  # surely too long; skip tokenizing megabytes on the event loop
        return len(self.tokenizer.encode(text))  # as the engine tokenizes

    def check_ids(self, ids: Any, param: str) -> list[int]:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_request(f"{param} must be a list of integers", param)
        if not ids:
            raise bad_request(f"{param} must not be empty", param)
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise bad_request(f"{param}: token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})",
                              param)
        return ids

    def check_budget(self, num_prompt_tokens: int, max_new_tokens: int, *, prompt_param: str,
                     max_param: str) -> None:
        ctx = self.context_length
        if num_prompt_tokens <= 0:
            raise bad_request(f"{prompt_param} is empty", prompt_param)
        if num_prompt_tokens == TOO_LONG:
            raise bad_request(f"{prompt_param} is far longer than the model's context length of {ctx} tokens",
                              prompt_param)
        if num_prompt_tokens >= ctx:
            raise bad_request(f"{prompt_param} has {num_prompt_tokens} tokens, which does not fit the model's "
                              f"context length of {ctx} tokens", prompt_param)
        if num_prompt_tokens + max_new_tokens > ctx:
            raise bad_request(f"{max_param} ({max_new_tokens}) plus the prompt ({num_prompt_tokens} tokens) "
                              f"exceeds the context length of {ctx} tokens; lower {max_param}", max_param)

    def token_text(self, token_id: int) -> str:
        return self._token_texts.get_or_create(token_id, lambda: self.tokenizer.decode([token_id]))

    # ---- engine calls -------------------------------------------------------------------

    def _start(self, g: GenInput, stream: bool) -> Any:
        return self.engine.async_generate(
            prompt=g.text, sampling_params=g.sampling, input_ids=g.input_ids,
            return_logprob=g.return_logprob, logprob_start_len=g.logprob_start_len,
            top_logprobs_num=g.top_logprobs_num, stream=stream, rid=g.rid, **engine_kwargs(g.bootstrap))

    async def _generate_one(self, g: GenInput) -> Any:
        t0 = time.perf_counter()
        self.active[g.rid] = t0
        try:
            out = await self._start(g, stream=False)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None
        finally:
            self.active.pop(g.rid, None)
        outs = out if isinstance(out, list) else [out]
        for o in outs:
            err = abort_chunk_error(o)
            if err is not None:
                raise err
        for o in outs:
            self.metrics.observe_generation(meta_of(o), time.perf_counter() - t0, None)
        return out

    async def generate(self, request: Request, gens: list[GenInput]) -> list[Any]:
        """Run `gens` concurrently (each its own engine request); abort all on failure or disconnect."""
        tasks = [asyncio.ensure_future(self._generate_one(g)) for g in gens]

        def abort_all() -> None:
            for t in tasks:
                t.cancel()
            for g in gens:
                self.abort(g.rid)

        try:
            return await await_or_disconnect(request, asyncio.gather(*tasks), abort_all)
        except ClientDisconnected:
            raise
        except BaseException:
            abort_all()
            raise

    async def open_streams(self, request: Request, subs: list[GenInput]) -> list[StreamHandle]:
        """Open one stream per input; if any fails, close those already open, then raise."""
        handles: list[StreamHandle] = []
        try:
            for s in subs:
                handles.append(await self.open_stream(request, s))
        except BaseException:
            for h in handles:
                h.close()
            raise
        return handles

    async def open_stream(self, request: Request, g: GenInput) -> StreamHandle:
        """Start a streaming generation and wait for its first chunk (so errors are still 4xx)."""
        t0 = time.perf_counter()
        self.active[g.rid] = t0
        it: Any = None

        async def first_chunk() -> dict[str, Any]:
            nonlocal it
            res = self._start(g, stream=True)
            if inspect.isawaitable(res) and not hasattr(res, "__anext__"):
                res = await res
            it = res
            return await it.__anext__()

        def abort() -> None:
            self.active.pop(g.rid, None)
            self.abort(g.rid)

        try:
            first = await await_or_disconnect(request, first_chunk(), abort)
        except (ValueError, TypeError) as e:
            abort()
            raise bad_request(str(e)) from None
        except StopAsyncIteration:
            abort()
            raise APIError("engine ended the stream without output", 500) from None
        except BaseException:
            abort()
            raise
        err = abort_chunk_error(first)
        if err is not None:
            self.active.pop(g.rid, None)
            raise err
        return StreamHandle(first, it, g.rid, t0, time.perf_counter() - t0, self)

    def abort(self, rid: str) -> None:
        """The request, or every sample of an n > 1 one (the engine finds them by rid)."""
        with contextlib.suppress(Exception):
            self.engine.abort(rid)

    def abort_all(self) -> int:
        rids = list(self.active)
        for rid in rids:
            self.abort(rid)
        self.active.clear()
        return len(rids)


def _sub(param: str, key: str) -> str:
    return f"{param}.{key}" if param else key


def check_regex(pattern: str, param: str) -> None:
    problem = regex_problem(pattern)
    if problem is not None:
        raise bad_request(f"{param} is not a valid regular expression: {problem}", param)


def check_json_schema(spec: str, param: str) -> dict[str, Any] | bool:
    try:
        schema = json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as e:  # "[" * 5000
        raise bad_request(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON object (a JSON Schema), got {type(schema).__name__}", param)
    try:
        import jsonschema
    except ImportError:
        return schema
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise bad_request(f"{param} is not a valid JSON Schema: {e.message}", param) from None
    except Exception as e:  # e.g. unresolvable $schema; the grammar compiler decides later
        logger.debug("schema check skipped: %s", e)
    return schema
