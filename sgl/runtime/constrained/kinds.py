"""The constraint kinds a request may carry, declared once (torch-free on purpose).

Each kind is also the name of a `SamplingParams` field holding its spec, and the
grammar registry compiles exactly these. The DSL, the server and the sampling schema
read this list, and the DSL never imports torch, so it lives here rather than in
registry.py (which re-exports it as `KINDS`).
"""

from __future__ import annotations

# regex / json_schema / ebnf / lark: a spec string; choices: a list of strings.
CONSTRAINT_KINDS: tuple[str, ...] = ("regex", "json_schema", "ebnf", "lark", "choices")
