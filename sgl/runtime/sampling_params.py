"""The one declaration of every sampling parameter: `SamplingParams` (validated plain data).

Field names follow SGLang's `sampling_params`, so a dict sent to SGLang works here.
Everything else is derived from these fields: the keys `sgl.gen` and `run()` accept,
what the interpreter sends, the native `/generate` validation, and the OpenAI request
models (which add only their renames, e.g. `max_tokens`). The constraint fields are the
grammar layer's kinds (constrained/kinds.py). This module must stay free of torch: the
DSL imports it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

from sgl.runtime.constrained.kinds import CONSTRAINT_KINDS


def regex_problem(pattern: str) -> str | None:
    """Why Python's re refuses pattern, or None. Some refusals are not re.error:
    a{4294967295} overflows, "(" * 600 recurses."""
    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as e:
        return str(e) or type(e).__name__
    return None


# Largest n we accept; larger values are almost always a client bug and would pin KV.
MAX_N = 64

# SGLang's other spellings of our fields.
ALIASES = {"sampling_seed": "seed"}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    # Token healing (constrained/healing.py): back the prompt up over its last token(s) and
    # make the output start by spelling them. Not an SGLang parameter. Off by default for API
    # requests (a raw-text caller gets exactly the continuation of its tokens); the DSL
    # turns it on for its gens on an sgl backend.
    token_healing: bool = False
    # Constraints (CONSTRAINT_KINDS): at most one of these may be set.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    lark: str | None = None
    choices: list[str] | None = None

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> "SamplingParams":
        """Build from a user dict, rejecting unknown keys and bad values with ValueError."""
        d = dict(d or {})
        for alias, name in ALIASES.items():
            if alias in d:
                d.setdefault(name, d.pop(alias))
        unknown = sorted(set(d) - set(FIELD_NAMES))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(FIELD_NAMES)}")
        for k in ("stop", "stop_regex"):
            if isinstance(d.get(k), str):
                d[k] = [d[k]]
        if isinstance(d.get("json_schema"), dict):
            d["json_schema"] = json.dumps(d["json_schema"])
        d = {k: v for k, v in d.items() if v is not None}
        p = SamplingParams(**d)
        p.validate()
        return p

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        need(is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
             f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        need(is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
             f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        need(self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")
        need(is_num(self.temperature) and self.temperature >= 0,
             f"temperature must be a number >= 0, got {self.temperature!r}")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
             f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            val = getattr(self, name)
            need(is_num(val) and -2 <= val <= 2, f"{name} must be in [-2, 2], got {val!r}")
        need(is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        for name in _BOOL_FIELDS:
            val = getattr(self, name)
            need(isinstance(val, bool), f"{name} must be true or false, got {val!r}")
        need(is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        need(self.seed is None or is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "stop must be a non-empty string or a list of non-empty strings")
        need(isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be a list of non-negative integers")
        need(isinstance(self.stop_regex, list) and all(isinstance(s, str) and s for s in self.stop_regex),
             "stop_regex must be a string or a list of strings")
        for pattern in self.stop_regex:
            problem = regex_problem(pattern)
            if problem is not None:
                raise ValueError(f"stop_regex {pattern[:80]!r} is not a valid regex: {problem}")
        set_constraints = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        need(len(set_constraints) <= 1, f"at most one constraint may be set, got {set_constraints}")
        for k in CONSTRAINT_KINDS:
            val = getattr(self, k)
            if k == "choices":
                need(val is None or (isinstance(val, list) and len(val) > 0 and all(isinstance(c, str) for c in val)),
                     "choices must be a non-empty list of strings")
            else:
                need(val is None or isinstance(val, str), f"{k} must be a string, got {type(val).__name__}")

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of the request's constraint, or None; a choices list is sent as its JSON text."""
        for k in CONSTRAINT_KINDS:
            val = getattr(self, k)
            if val is not None:
                return (k, json.dumps(val) if k == "choices" else val)
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))
# Annotations are strings here (postponed evaluation), hence the comparison with "bool".
_BOOL_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.type == "bool")
