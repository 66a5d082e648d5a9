"""The DSL's expression nodes: what a program appends to its state (`s += expr`).

Constant text, `gen`, `select`, role markers, variable scopes, fork markers. The nodes
are plain descriptions; the interpreter (interpreter.py) executes them against a backend
and the tracer (tracer.py) records them without running a model. `GenParams` holds a
gen's options (or a run's defaults): sampling parameters by their `SamplingParams` names,
the only place they are declared, plus the logprob request options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sgl.runtime.constrained.kinds import CONSTRAINT_KINDS
from sgl.runtime.sampling_params import ALIASES, FIELD_NAMES

if TYPE_CHECKING:
    from sgl.lang.choices import ChoicesSamplingMethod

# dtype= shortcuts, the same patterns as SGLang so outputs parse the same way.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

# What typed gens send: the same value patterns, plus the whitespace the model wants around
# the value. One optional leading space or newline (after "Answer:" a byte-level model's next
# token is " " or " 2x", which SGLang's patterns forbid), and, for numbers, one optional trailing space
# or newline after which the pattern is complete, so the gen ends by itself where SGLang's
# " " and "\n" stops would end it (those stops would also fire on the leading space).
# The variable is stored without the surrounding whitespace, as SGLang stores it.
# After a prompt that already ends in whitespace the leading one is left out (`typed_regex`):
# the separator is there, token healing lets the model's first token cover it, and a second
# one only lets the model start a new paragraph instead of answering.
TYPED_VALUES = {
    "int": (r"[-+]?[0-9]+", r"[ \n]?"),
    "float": (r"[-+]?[0-9]*\.?[0-9]+", r"[ \n]?"),
    "bool": (r"(True|False)", ""),
    "str": (r"\"[\w\d\s]*\"", ""),
}
LEADING_WS = r"[ \n]?"


def typed_regex(kind: str, after_space: bool = False) -> str:
    """The pattern a typed gen of `kind` ("int", "float", "bool", "str") sends."""
    value, trail = TYPED_VALUES[kind]
    return ("" if after_space else LEADING_WS) + value + trail


# A DSL regex gen R is sent as this: R's match after an optional leading space and before
# an optional trailing space or newline (after which it is complete, so the gen ends where
# the model would end the value rather than being forced on into more of R). See
# interpreter.regex_result for how the whitespace is kept out of the variable. After a
# prompt ending in whitespace the leading space is left out, as for typed gens.
TOLERANT_REGEX = "[ ]?(?:{})[ \n]?"
TOLERANT_REGEX_AFTER_SPACE = "(?:{})[ \n]?"

# Keys that are request options rather than sampling parameters.
LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")

# The DSL's own spellings (SGLang's gen() says max_tokens; grammar= takes a Lark grammar).
DSL_RENAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "grammar": "lark", **ALIASES}


@dataclass
class GenParams:
    """A gen's options; a key that is absent inherits the value given to `run(...)`."""

    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field name -> value
    logprob: dict[str, Any] = field(default_factory=dict)  # LOGPROB_KEYS
    dtype: Any = None

    def merged_over(self, base: "GenParams") -> "GenParams":
        """A new GenParams: `base` with every option of self on top. A constraint (or dtype) of
        self replaces the base's, rather than making two."""
        own = self.dtype is not None or any(k in self.sampling for k in CONSTRAINT_KINDS)
        inherited = {k: v for k, v in base.sampling.items() if not (own and k in CONSTRAINT_KINDS)}
        return GenParams({**inherited, **self.sampling}, {**base.logprob, **self.logprob},
                         self.dtype if own else base.dtype)


def is_option(key: str) -> bool:
    """True if `key` names a sampling parameter (or a DSL spelling of one) or a logprob option."""
    return DSL_RENAMES.get(key, key) in FIELD_NAMES or key in LOGPROB_KEYS


def gen_params(options: dict[str, Any], where: str, dtype: Any = None) -> GenParams:
    """Sort keyword options into a GenParams (None = not given); unknown keys raise TypeError."""
    out = GenParams(dtype=dtype)
    for key, value in options.items():
        name = DSL_RENAMES.get(key, key)
        if not is_option(key):
            raise TypeError(f"{where}() got an unexpected keyword argument {key!r}; it takes the sampling "
                            f"parameters {sorted(FIELD_NAMES)} (max_tokens/min_tokens also work) and "
                            f"{list(LOGPROB_KEYS)}")
        if value is None:
            continue
        target = out.logprob if name in LOGPROB_KEYS else out.sampling
        if name in target:
            raise TypeError(f"{where}() got {name!r} twice (as {key!r} and under another name)")
        target[name] = value
    return out


class SglExpr:
    """Base node; `a + b` builds an expression list so `s += "Q: " + sgl.gen("a")` works."""

    def __add__(self, other: Any) -> "SglExprList":
        return _concat(self, _as_expr(other))

    def __radd__(self, other: Any) -> "SglExprList":
        return _concat(_as_expr(other), self)


def _as_expr(x: Any) -> SglExpr:
    if isinstance(x, SglExpr):
        return x
    if isinstance(x, str):
        return SglConstantText(x)
    raise TypeError(f"cannot add {type(x).__name__} to an sgl expression; use a str or an sgl expression")


def _concat(a: SglExpr, b: SglExpr) -> "SglExprList":
    left = a.expr_list if isinstance(a, SglExprList) else [a]
    right = b.expr_list if isinstance(b, SglExprList) else [b]
    return SglExprList(left + right)


class SglExprList(SglExpr):
    def __init__(self, expr_list: list[SglExpr]):
        self.expr_list = expr_list

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class SglConstantText(SglExpr):
    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class SglGen(SglExpr):
    def __init__(self, name: str | None, params: GenParams):
        self.name = name
        self.sampling_params = params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class SglSelect(SglExpr):
    def __init__(self, name: str | None, choices: list[str], temperature: float,
                 choices_method: "ChoicesSamplingMethod"):
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class SglRoleBegin(SglExpr):
    def __init__(self, role: str):
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    def __init__(self, role: str):
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class SglVarScopeBegin(SglExpr):
    def __init__(self, name: str):
        self.name = name


class SglVarScopeEnd(SglExpr):
    def __init__(self, name: str):
        self.name = name


class SglVariable(SglExpr):
    """A variable's value used as text; during tracing it stands for a not-yet-known value."""

    def __init__(self, name: str, source: Any = None):
        self.name = name
        self.source = source

    def __repr__(self) -> str:
        return f"Variable({self.name!r})"


class SglArgument(SglExpr):
    """Stand-in for a program argument while tracing; formatting it cannot be traced."""

    def __init__(self, name: str, value: Any = None):
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"Argument({self.name!r})"

    def __format__(self, spec: str) -> str:
        raise TypeError(
            f"cannot put argument {self.name!r} inside an f-string while tracing; "
            "append it as its own piece instead (s += 'Q: ' + arg)"
        )

    def __str__(self) -> str:
        return self.__format__("")


class SglFork(SglExpr):
    def __init__(self, size: int):
        self.size = size


class SglGetForkItem(SglExpr):
    def __init__(self, index: int):
        self.index = index


def role_exprs(role: str, body: Any = None) -> SglExprList:
    """A whole `role` turn around `body` (an expression, or any value as its text); empty if None."""
    if body is None:
        return SglExprList([SglRoleBegin(role), SglRoleEnd(role)])
    text = body if isinstance(body, SglExpr) else SglConstantText(str(body))
    return SglExprList([SglRoleBegin(role), text, SglRoleEnd(role)])
