"""StreamExecutor: runs one program state's expressions, in order, on a worker thread.

`s += expr` only queues the expression, so a program keeps going (and its forks run
side by side) while the backend works; reading `s["x"]` waits only until variable x
exists. The executor owns the prompt text, the OpenAI-style message list, variables
and their meta info. Any failure stops the state: the error is wrapped in a
`ProgramError` naming the program, the expression and the end of the prompt, every
waiter is woken, and the error is re-raised to whoever touches the state next.
"""

from __future__ import annotations

import queue
import re
import threading
import uuid
from collections import Counter
from typing import Any

from sgl.lang.backends.base import Backend, check_result
from sgl.lang.chat_template import ChatTemplate
from sgl.lang.ir import (TOLERANT_REGEX, TOLERANT_REGEX_AFTER_SPACE, TYPED_VALUES, GenParams,
                         SglConstantText, SglExpr, SglExprList, SglGen, SglRoleBegin, SglRoleEnd, SglSelect,
                         SglVariable, SglVarScopeBegin, SglVarScopeEnd, typed_regex)


class ProgramError(RuntimeError):
    """A program failed; `.state` is the failing ProgramState, `__cause__` the original error."""

    state: Any = None
    states: Any = None


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return [x] if isinstance(x, str) else list(x)


def dtype_constraint(dtype: Any, after_space: bool = False) -> tuple[str, list[str]]:
    """(regex, extra stop strings) for gen(dtype=...): SGLang's value patterns with the
    whitespace the model may want around the value (ir.py typed_regex), no stops.
    `after_space`: the prompt already ends in a space or newline (no leading one then)."""
    kind = dtype.__name__ if dtype in (int, float, str, bool) else dtype
    if not isinstance(kind, str) or kind not in TYPED_VALUES:  # also an unhashable dtype
        raise ValueError(f"gen(dtype=...) must be int, float, str or bool, got {dtype!r}")
    return typed_regex(kind, after_space), []


def typed_result(text: str) -> tuple[str, str]:
    """(text appended to the prompt, variable) of a typed gen's output: the variable is the
    value alone, as SGLang's; the prompt keeps the leading space the model chose and drops
    the trailing whitespace, as SGLang's stop strings drop it."""
    shown = text.rstrip(" \n")
    return shown, shown.lstrip(" \n")


def regex_result(text: str, regex: str) -> tuple[str, str]:
    """(text appended to the prompt, variable) of a regex gen sent as TOLERANT_REGEX: the
    variable is the text without the optional leading space and trailing space/newline,
    unless the user's regex itself matches them; the prompt keeps the leading space and
    drops the trailing one with the variable."""
    lead = 1 if text.startswith(" ") else 0
    trail = 1 if text[lead:].endswith((" ", "\n")) else 0
    for a, b in ((0, 0), (lead, 0), (0, trail), (lead, trail)):
        value = text[a: len(text) - b]
        if re.fullmatch(regex, value):
            return text[: len(text) - b], value
    return text, text


def json_result(text: str) -> str:
    """The variable of a JSON Schema gen: its text without the whitespace the constraint
    allows before the value (after "Answer:" the model writes ` {"`); the prompt keeps it."""
    return text.lstrip(" \t\n\r")


class StreamExecutor:
    def __init__(self, backend: Backend, arguments: dict[str, Any], default_params: GenParams,
                 chat_template: ChatTemplate | None = None, stream: bool = False, program_name: str = "program"):
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_params = default_params
        self.stream = stream
        self.program_name = program_name
        self.chat_template = chat_template or backend.get_chat_template()

        self.text_ = ""
        self.messages_: list[dict] = []
        self.variables: dict[Any, Any] = {}
        # Writes of each variable submitted and not yet done: a reader waits for the last
        # (a name reused in a loop reads its final value, as the program text says).
        self._pending: Counter[Any] = Counter()
        self.meta_info: dict[Any, Any] = {}
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self.fork_start_text_pos: int | None = None
        self._scope_starts: dict[str, int] = {}
        self.error_: ProgramError | None = None
        self.is_finished = False
        self.cond = threading.Condition()  # notified on every text/variable change (streaming)

        self._queue: queue.Queue = queue.Queue()
        self._ended = False
        self._worker = threading.Thread(target=self._work, name=f"sgl-{program_name}", daemon=True)
        self._worker.start()

    # ---- called from the program's thread -----------------------------------------

    def submit(self, expr: SglExpr | str) -> None:
        if self.error_ is not None:
            raise self.error_
        if self._ended:
            raise RuntimeError("this program state has ended (joined or finished); it cannot take more expressions")
        with self.cond:
            self._count_writes(expr)
        self._queue.put(expr)

    def sync(self) -> None:
        self._queue.join()

    def var_done(self, name: Any) -> bool:
        """No submitted write of `name` is still to come."""
        with self.cond:
            return self._pending[name] == 0

    def _wait_var(self, name: Any) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self._pending[name] == 0 or self.error_ is not None)

    def get_var(self, name: Any) -> Any:
        self._wait_var(name)
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise self.error_
        raise KeyError(f"program {self.program_name!r} has no variable {name!r}")

    def set_var(self, name: Any, value: Any) -> None:
        with self.cond:
            self.variables[name] = value
            self.cond.notify_all()

    def get_meta_info(self, name: Any) -> Any:
        self._wait_var(name)
        return self.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.text_

    def messages(self) -> list[dict]:
        self.sync()
        return self.messages_

    def error(self) -> ProgramError | None:
        self.sync()
        return self.error_

    def fork(self, size: int) -> list["StreamExecutor"]:
        size = int(size)
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        self.sync()
        if self.error_ is not None:
            raise self.error_
        if size > 1 and self.text_:
            # Prefill the shared prefix once so the forks' requests all hit the radix cache.
            self.backend.cache_prefix(self.text_)
        children = []
        for _ in range(size):
            c = StreamExecutor(self.backend, self.arguments, self.default_params, self.chat_template,
                               self.stream, self.program_name)
            c.variables = dict(self.variables)
            c.meta_info = dict(self.meta_info)
            c.text_ = self.text_
            c.messages_ = list(self.messages_)
            c.cur_role = self.cur_role
            c.cur_role_begin_pos = self.cur_role_begin_pos
            c.fork_start_text_pos = len(self.text_)
            children.append(c)
        return children

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._queue.put(None)

    # ---- worker thread --------------------------------------------------------------

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is None:
                    break
                if self.error_ is None:
                    try:
                        self._execute(expr)
                    except BaseException as e:  # noqa: BLE001 - reported through the state
                        self._fail(expr, e)
            finally:
                self._queue.task_done()
        with self.cond:
            self.is_finished = True
            self.cond.notify_all()

    def _fail(self, expr: Any, e: BaseException) -> None:
        tail = self.text_[-120:]
        err = e if isinstance(e, ProgramError) else ProgramError(
            f"sgl program {self.program_name!r} failed at {expr!r}: {type(e).__name__}: {e}\n"
            f"  prompt so far ({len(self.text_)} chars) ends with: {tail!r}")
        if err is not e:
            err.__cause__ = e
        with self.cond:
            self.error_ = err
            self.cond.notify_all()

    def _count_writes(self, expr: Any) -> None:
        if isinstance(expr, (SglGen, SglSelect, SglVarScopeBegin)):
            self._pending[expr.name] += 1
        elif isinstance(expr, SglExprList):
            for e in expr.expr_list:
                self._count_writes(e)

    def _append(self, text: str) -> None:
        with self.cond:
            self.text_ += text
            self.cond.notify_all()

    def _execute(self, expr: Any) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, SglConstantText):
            self._append(str(expr.value))
        elif isinstance(expr, SglExprList):
            for e in expr.expr_list:
                self._execute(e)
        elif isinstance(expr, SglGen):
            self._execute_gen(expr)
        elif isinstance(expr, SglSelect):
            self._execute_select(expr)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, SglVarScopeBegin):
            self._scope_starts[expr.name] = len(self.text_)
        elif isinstance(expr, SglVarScopeEnd):
            self._set_var(expr.name, self.text_[self._scope_starts.pop(expr.name):], None)
        elif isinstance(expr, SglVariable):
            src = expr.source if isinstance(expr.source, StreamExecutor) else self
            self._append(str(src.get_var(expr.name)))
        else:
            raise TypeError(f"cannot append {type(expr).__name__} to a program state")

    def _set_var(self, name: Any, value: Any, meta: Any) -> None:
        with self.cond:
            self.variables[name] = value
            self.meta_info[name] = meta
            if self._pending[name] > 0:
                self._pending[name] -= 1
            self.cond.notify_all()

    def request_for(self, params: GenParams) -> tuple[dict, dict]:
        """(sampling_params, logprob options) for a gen, after defaults, dtype and chat stops."""
        p = params.merged_over(self.default_params)
        sp = dict(p.sampling)
        stop = _as_list(sp.pop("stop", None))
        after_space = self.text_.endswith((" ", "\n"))
        if p.dtype is not None:
            regex, extra = dtype_constraint(p.dtype, after_space)
            sp["regex"] = regex
            stop += extra
        elif sp.get("regex") is not None:
            sp["regex"] = (TOLERANT_REGEX_AFTER_SPACE if after_space else TOLERANT_REGEX).format(sp["regex"])
        if self.backend.supports_token_healing and "token_healing" not in sp:
            sp["token_healing"] = True  # heal the prompt/gen boundary (sgl backends only)
        if self.cur_role == "assistant":
            stop += [s for s in self.chat_template.stop_str if s not in stop]
        if stop:
            sp["stop"] = stop
        if "stop_regex" in sp:
            sp["stop_regex"] = _as_list(sp["stop_regex"])
        for k in ("stop_token_ids", "stop_regex"):
            if k in sp and not sp[k]:
                del sp[k]
        if sp.get("n") == 1:
            del sp["n"]
        return sp, dict(p.logprob)

    def _execute_gen(self, expr: SglGen) -> None:
        sp, opts = self.request_for(expr.sampling_params)
        merged = expr.sampling_params.merged_over(self.default_params)
        typed = merged.dtype is not None
        user_regex = None if typed else merged.sampling.get("regex")
        is_json = not typed and merged.sampling.get("json_schema") is not None
        if not self.stream or sp.get("n", 1) > 1 or typed or user_regex is not None:
            res = self.backend.generate(self.text_, sp, **opts)
            results = res if isinstance(res, list) else [res]
            pairs = [(check_result(r)["text"],) * 2 for r in results]
            if typed:
                pairs = [typed_result(t) for t, _ in pairs]
            elif user_regex is not None:
                pairs = [regex_result(t, user_regex) for t, _ in pairs]
            elif is_json:
                pairs = [(t, json_result(t)) for t, _ in pairs]
            self._append(pairs[0][0])
            if isinstance(res, list):
                self._set_var(expr.name, [v for _, v in pairs], [r["meta_info"] for r in res])
            else:
                self._set_var(expr.name, pairs[0][1], res["meta_info"])
            return
        with self.cond:
            self.variables[expr.name] = ""
        shown = 0
        meta = None
        for res in self.backend.generate_stream(self.text_, sp, **opts):
            check_result(res)
            piece = res["text"][shown:]
            shown = len(res["text"])
            meta = res.get("meta_info")
            with self.cond:
                self.text_ += piece
                self.variables[expr.name] += piece
                self.meta_info[expr.name] = meta
                self.cond.notify_all()
        value = self.variables[expr.name]
        self._set_var(expr.name, json_result(value) if is_json else value, meta)

    def _execute_select(self, expr: SglSelect) -> None:
        decision = self.backend.select(self.text_, expr.choices, expr.temperature, expr.choices_method)
        self._append(decision.decision if decision.text is None else decision.text)
        self._set_var(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"cannot begin a {role} turn inside the open {self.cur_role} turn; roles do not nest")
        if not self.messages_ and role != "system" and self.chat_template.default_system_prompt:
            self._role_begin("system")
            self._append(self.chat_template.default_system_prompt)
            self._role_end("system")
        self.cur_role = role
        self._append(self.chat_template.get_prefix_and_suffix(role, self.messages_)[0])
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"{role}_end without a matching {role}_begin (open turn: {self.cur_role})")
        content = self.text_[self.cur_role_begin_pos:].lstrip()
        self._append(self.chat_template.get_prefix_and_suffix(role, self.messages_)[1])
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None
        self.cur_role_begin_pos = None
