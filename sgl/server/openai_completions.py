"""POST /v1/completions: prompt(s) -> engine -> OpenAI `text_completion` shapes.

parse (`parse_completion`: prompts, budgets, sampling, logprob options) -> generate
(`generate_groups`, or `stream_choices` with one engine stream per choice) -> format
(`format_completion`, or `CompletionStream` for the SSE deltas). A prompt is a string,
a list of strings, a token id list or a list of those; each is its own engine request.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sgl.server.engine_client import EngineClient, GenInput, client_of, finish_of, meta_of, new_rid, split_n
from sgl.server.errors import bad_request
from sgl.server.openai_api import (Envelope, check_model, completion_logprobs, finish_reason, generate_groups,
                                   response_format_schema, sampling_from, stream_choices, usage_of, wants_usage)
from sgl.server.openai_protocol import MAX_N, CompletionRequest
from sgl.server.pd import bootstraps

Prompt = tuple[str | None, list[int] | None]  # (text, None) or (None, token ids)


def register(app: FastAPI) -> None:
    app.add_api_route("/v1/completions", completions, methods=["POST"])


async def completions(req: CompletionRequest, request: Request) -> Response:
    client = client_of(request)
    job = parse_completion(req, client, check_model(request, req.model))
    if not req.stream:
        return JSONResponse(format_completion(job, client, await generate_groups(request, client, job.gens)))
    subs = [(pi, s) for pi, g in enumerate(job.gens) for s in split_n(g)]
    prompt_of = [pi for pi, _ in subs]
    return await stream_choices(request, client, [s for _, s in subs], prompt_of, job.envelope,
                                CompletionStream(job, client, prompt_of), wants_usage(req.stream_options))


# ---- parse --------------------------------------------------------------------------------

@dataclass
class CompletionJob:
    req: CompletionRequest
    gens: list[GenInput]  # one per prompt
    echo_texts: list[str]  # per prompt, what `echo` puts before the completion ("" without echo)
    envelope: Envelope


def parse_completion(req: CompletionRequest, client: EngineClient, model: str) -> CompletionJob:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (best-of sampling is not supported)", "best_of")
    prompts = _prompts(req.prompt)
    if len(prompts) * req.n > MAX_N:
        raise bad_request(f"{len(prompts)} prompts x n={req.n} exceeds {MAX_N} choices", "n")
    max_new = 16 if req.max_tokens is None else req.max_tokens
    sp = sampling_from(req, client, max_new, response_format_schema(req.response_format))
    want_lp = req.logprobs is not None
    rooms = bootstraps(client.engine, req.bootstrap_host, req.bootstrap_port, req.bootstrap_room, len(prompts), req.n)
    gens = []
    for pi, (text, ids) in enumerate(prompts):
        if text is not None:
            if not text:
                raise bad_request("prompt is empty", "prompt")
            num = client.count_tokens(text)
        else:
            num = len(client.check_ids(ids, "prompt"))
        client.check_budget(num, max_new, prompt_param="prompt", max_param="max_tokens")
        gens.append(GenInput(text, ids, sp, new_rid("cmpl-"), want_lp, 0 if (want_lp and req.echo) else None,
                             req.logprobs if want_lp else None, num, rooms[pi] if rooms is not None else None))
    echo = [(text if text is not None else client.tokenizer.decode(ids)) if req.echo else "" for text, ids in prompts]
    return CompletionJob(req, gens, echo, Envelope("cmpl-" + uuid.uuid4().hex, "text_completion", model))


def _prompts(p: Any) -> list[Prompt]:
    if isinstance(p, str):
        return [(p, None)]
    if p and all(isinstance(x, str) for x in p):
        return [(x, None) for x in p]
    if p and all(isinstance(x, int) for x in p):
        return [(None, p)]
    if p and all(isinstance(x, list) for x in p):
        return [(None, x) for x in p]
    raise bad_request("prompt must be a non-empty string, list of strings, or token id list(s)", "prompt")


# ---- format -------------------------------------------------------------------------------

def format_completion(job: CompletionJob, client: EngineClient, groups: list[list[dict[str, Any]]]) -> dict[str, Any]:
    choices = []
    for pi, group in enumerate(groups):
        for out in group:
            fr, matched = finish_reason(finish_of(out))
            lp = completion_logprobs(client, meta_of(out), job.req.echo) if job.req.logprobs is not None else None
            choices.append({"index": len(choices), "text": job.echo_texts[pi] + out.get("text", ""), "logprobs": lp,
                            "finish_reason": fr, "matched_stop": matched})
    return job.envelope.body(choices, usage=usage_of([[meta_of(o) for o in group] for group in groups]))


class CompletionStream:
    """Text deltas (echo first), new logprob entries, then the finish reason (a ChoiceRenderer)."""

    def __init__(self, job: CompletionJob, client: EngineClient, prompt_of: list[int]) -> None:
        self.job, self.client, self.prompt_of = job, client, prompt_of

    def opening(self, n: int) -> list[dict[str, Any]]:
        return []

    def on_chunk(self, i: int, chunk: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
        text = chunk.get("text", "")
        delta = text[len(state.get("sent", "")):]
        state["sent"] = text
        if not state.get("echoed"):
            delta = self.job.echo_texts[self.prompt_of[i]] + delta
            state["echoed"] = True
        fr, matched = finish_reason(finish_of(chunk))
        lp = None
        if self.job.req.logprobs is not None:
            # Engine chunks carry cumulative logprobs; send only the entries not sent yet.
            full = completion_logprobs(self.client, meta_of(chunk), self.job.req.echo)
            lp = {k: v[state.get("lp_sent", 0):] for k, v in full.items()}
            state["lp_sent"] = len(full["tokens"])
        if not delta and fr is None and not (lp and lp["tokens"]):
            return []
        c = {"index": i, "text": delta, "logprobs": lp, "finish_reason": fr}
        if fr is not None:
            c["matched_stop"] = matched
        return [c]

    def on_finish(self, i: int, chunk: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
        return []
