"""Per-request plain data: sampling parameters (validated), finish reasons.

Field names follow SGLang's `sampling_params` so that a dict sent to SGLang works here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# Largest n we accept; larger values are almost always a client bug and would pin KV.
MAX_N = 64


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
    # Constraints: at most one of these may be set.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    lark: str | None = None
    choices: list[str] | None = None

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> "SamplingParams":
        """Build from a user dict, rejecting unknown keys and bad values with ValueError."""
        d = dict(d or {})
        if "sampling_seed" in d:  # SGLang's name for the seed
            d.setdefault("seed", d.pop("sampling_seed"))
        known = {f.name for f in fields(SamplingParams)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if isinstance(d.get("stop_regex"), str):
            d["stop_regex"] = [d["stop_regex"]]
        if isinstance(d.get("json_schema"), dict):
            import json

            d["json_schema"] = json.dumps(d["json_schema"])
        d = {k: v for k, v in d.items() if v is not None or k in ("seed",)}
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
        need(is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        need(self.seed is None or is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "stop must be a non-empty string or a list of non-empty strings")
        need(isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be a list of non-negative integers")
        need(isinstance(self.stop_regex, list) and all(isinstance(s, str) and s for s in self.stop_regex),
             "stop_regex must be a string or a list of strings")
        for pattern in self.stop_regex:
            import re

            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regex: {e}") from None
        set_constraints = [k for k in ("regex", "json_schema", "ebnf", "lark", "choices") if getattr(self, k) is not None]
        need(len(set_constraints) <= 1, f"at most one constraint may be set, got {set_constraints}")
        for k in ("regex", "json_schema", "ebnf", "lark"):
            val = getattr(self, k)
            need(val is None or isinstance(val, str), f"{k} must be a string, got {type(val).__name__}")
        if self.choices is not None:
            need(isinstance(self.choices, list) and len(self.choices) > 0
                 and all(isinstance(c, str) for c in self.choices), "choices must be a non-empty list of strings")

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of the request's constraint, or None."""
        for k in ("regex", "json_schema", "ebnf", "lark"):
            val = getattr(self, k)
            if val is not None:
                return (k, val)
        if self.choices is not None:
            import json

            return ("choices", json.dumps(self.choices))
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
