"""Engine input normalization and result shaping (plain data in, plain dicts out).

Turns SGLang-style `generate` arguments (single or batch, text or ids, per-prompt or
shared sampling params, n>1) into a flat list of request specs, and scheduler outputs
into SGLang's `{"text", "output_ids", "meta_info"}` dicts.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

from sgl.runtime.disaggregation.protocol import Bootstrap
from sgl.runtime.disaggregation.rooms import expand_bootstrap
from sgl.runtime.sampling_params import SamplingParams
from sgl.runtime.scheduler.req import ReqOutput


@dataclass
class ReqSpec:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    bootstrap: Bootstrap | None = None  # PD: this sample's room (disaggregation/rooms.py)


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts")
        return value
    return [value] * n


def normalize(
    tokenizer: Any, prompt: Any, input_ids: Any, sampling_params: Any, return_logprob: Any,
    logprob_start_len: Any, top_logprobs_num: Any, return_text_in_logprobs: bool, rid: Any,
    vocab_size: int, context_length: int, bootstrap: tuple[Any, Any, Any] = (None, None, None),
    default_bootstrap_port: int = 8998,
) -> tuple[list[ReqSpec], bool]:
    """Returns (specs, is_batch). n>1 expands into n specs per prompt, in order.
    `bootstrap` is SGLang's (bootstrap_host, bootstrap_port, bootstrap_room), scalars or
    lists, expanded to one room per sample by disaggregation/rooms.py."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of `prompt` (text) or `input_ids`")
    if prompt is not None:
        is_batch = isinstance(prompt, list)
        texts = prompt if is_batch else [prompt]
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("prompt must be a string or a list of strings")
        ids_list = [tokenizer.encode(t) for t in texts]
    else:
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        is_batch = isinstance(input_ids[0], list)
        ids_list = input_ids if is_batch else [input_ids]
    n_prompts = len(ids_list)
    params_list = _per_item(sampling_params, n_prompts, "sampling_params")
    lp_list = _per_item(return_logprob, n_prompts, "return_logprob")
    start_list = _per_item(logprob_start_len, n_prompts, "logprob_start_len")
    top_list = _per_item(top_logprobs_num, n_prompts, "top_logprobs_num")
    rid_list = _per_item(rid, n_prompts, "rid") if rid is not None else [None] * n_prompts
    specs: list[ReqSpec] = []
    params_all = [SamplingParams.from_dict(params_list[i]) for i in range(n_prompts)]
    n_each = {p.n for p in params_all}
    if len(n_each) > 1 and bootstrap[2] is not None:
        raise ValueError("a PD request (bootstrap_room) needs the same n for every prompt of the batch")
    rooms = expand_bootstrap(*bootstrap, n_prompts, n_each.pop() if n_each else 1, default_bootstrap_port)
    for i, ids in enumerate(ids_list):
        if not ids:
            raise ValueError(f"prompt {i} is empty after tokenization")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"input_ids of prompt {i} must be integers in [0, {vocab_size})")
        params = params_all[i]
        if len(ids) + params.max_new_tokens > context_length:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens and asks for max_new_tokens={params.max_new_tokens}; "
                f"together they exceed the context length {context_length}")
        start = start_list[i]
        start = -1 if start is None else int(start)
        if start >= len(ids):
            raise ValueError(f"logprob_start_len={start} must be < the prompt length {len(ids)}")
        top = int(top_list[i] or 0)
        if top < 0 or top > 100:
            raise ValueError(f"top_logprobs_num must be in [0, 100], got {top}")
        base_rid = rid_list[i] or uuid.uuid4().hex
        for k in range(params.n):
            # Seeded samples differ: sample k takes seed + k (as the server's streamed n does)
            own = params if params.seed is None or params.n == 1 else replace(params, seed=params.seed + k)
            specs.append(ReqSpec(
                rid=base_rid if params.n == 1 else sample_rid(base_rid, k),
                input_ids=list(ids), params=own, return_logprob=bool(lp_list[i]),
                logprob_start_len=start if lp_list[i] else -1, top_logprobs_num=top if lp_list[i] else 0,
                return_text_in_logprobs=return_text_in_logprobs,
                bootstrap=rooms[i][k] if rooms is not None else None,
            ))
    return specs, is_batch or (len(specs) > 1)


def sample_rid(rid: str, k: int) -> str:
    """The rid sample k of an n > 1 request runs under (here and in the server's streamed n)."""
    return f"{rid}-{k}"


def is_sample_of(candidate: str, rid: str) -> bool:
    head, sep, k = candidate.rpartition("-")
    return bool(sep) and head == rid and k.isdigit()


def _with_text(tokenizer: Any, entries: list | None) -> list | None:
    if entries is None:
        return None
    return [(lp, t, tokenizer.decode([t])) for lp, t, _ in entries]


def to_result(tokenizer: Any, spec: ReqSpec, out: ReqOutput) -> dict[str, Any]:
    meta = dict(out.meta_info)
    if spec.return_logprob and spec.return_text_in_logprobs:
        for key in ("input_token_logprobs", "output_token_logprobs"):
            meta[key] = _with_text(tokenizer, meta.get(key))
        for key in ("input_top_logprobs", "output_top_logprobs"):
            meta[key] = [_with_text(tokenizer, x) for x in meta.get(key, [])]
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}
