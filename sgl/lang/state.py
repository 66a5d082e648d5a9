"""ProgramState (the `s` a program writes to) and ProgramStateGroup (what `s.fork(n)` returns).

The state is a thin user-facing shell over a StreamExecutor: `+=` submits, `s["x"]`
waits for one variable, roles and var scopes come from roles.py, and the streaming
iterators read the executor's text as it grows.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Any, Iterator

from sgl.lang.interpreter import ProgramError, StreamExecutor
from sgl.lang.ir import SglConstantText, SglExpr
from sgl.lang.roles import RoleWriter


class ProgramState(RoleWriter):
    def __init__(self, stream_executor: StreamExecutor):
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # ---- building the prompt ------------------------------------------------------

    def __iadd__(self, other: Any) -> "ProgramState":
        if other is None:
            raise ValueError("cannot append None to a program state")
        if not isinstance(other, (str, SglExpr)):
            other = SglConstantText(str(other))
        self.stream_executor.submit(other)
        return self

    def _write(self, expr: SglExpr) -> None:
        self.stream_executor.submit(expr)

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> "ProgramStateGroup":
        return ProgramStateGroup([ProgramState(e) for e in self.stream_executor.fork(size)], self)

    @contextmanager
    def copy(self) -> Iterator["ProgramState"]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # ---- reading --------------------------------------------------------------------

    def __getitem__(self, name: Any) -> Any:
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: Any, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def __contains__(self, name: Any) -> bool:
        return name in self.stream_executor.variables

    def get_var(self, name: Any) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: Any, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: Any) -> Any:
        return self.stream_executor.get_meta_info(name)

    def text(self) -> str:
        return self.stream_executor.text()

    def messages(self) -> list[dict]:
        return self.stream_executor.messages()

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> ProgramError | None:
        return self.stream_executor.error()

    # ---- streaming --------------------------------------------------------------------

    def _pieces(self, var_name: Any = None) -> Iterator[tuple[str, Any]]:
        exe = self.stream_executor
        if not exe.stream:
            yield (self.text() if var_name is None else str(self.get_var(var_name))), exe.meta_info.get(var_name)
            return
        shown = 0
        while True:
            with exe.cond:
                def ready() -> bool:
                    cur = exe.text_ if var_name is None else exe.variables.get(var_name, "")
                    return len(str(cur)) > shown or self._done(var_name)
                exe.cond.wait_for(ready)
                cur = str(exe.text_ if var_name is None else exe.variables.get(var_name, ""))
                done = self._done(var_name)
                meta = exe.meta_info.get(var_name)
            if len(cur) > shown:
                yield cur[shown:], meta
                shown = len(cur)
            if done:
                break
        if exe.error_ is not None:
            raise exe.error_

    def _done(self, var_name: Any) -> bool:
        exe = self.stream_executor
        if exe.is_finished or exe.error_ is not None:
            return True
        if var_name is None:
            return False
        return exe.var_done(var_name)

    def text_iter(self, var_name: Any = None) -> Iterator[str]:
        """Pieces of the text (or of one variable) as they are generated (stream=True)."""
        for piece, _ in self._pieces(var_name):
            yield piece

    async def text_async_iter(self, var_name: Any = None, return_meta_data: bool = False):
        loop = asyncio.get_running_loop()
        it = self._pieces(var_name)
        end = object()
        while True:
            item = await loop.run_in_executor(None, next, it, end)
            if item is end:
                break
            yield item if return_meta_data else item[0]

    def __del__(self) -> None:
        try:
            self.stream_executor.end()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    def __init__(self, states: list[ProgramState], src_state: ProgramState | None = None):
        self.states = states
        self.src_state = src_state

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:
            raise TypeError("fork items can only be extended in place (forks[i] += ...)")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        if isinstance(other, (str, SglExpr)):
            for s in self.states:
                s += other
        elif callable(other):
            for i, s in enumerate(self.states):
                s += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} expressions for {len(self.states)} forks")
            for s, e in zip(self.states, other):
                s += e
        else:
            raise TypeError(f"cannot append {type(other).__name__} to forks")
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every fork; variables new in the forks become lists on the parent."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"unknown join mode {mode!r}")
        assert self.src_state is not None
        parent = self.src_state.stream_executor
        if mode == "concate_and_append":
            for s in self.states:
                s.sync()
                exe = s.stream_executor
                if exe.error_ is not None:
                    raise exe.error_
                parent.submit(SglConstantText(exe.text_[exe.fork_start_text_pos:]))
        else:
            before = set(parent.variables)
            for s in self.states:
                s.sync()
                exe = s.stream_executor
                if exe.error_ is not None:
                    raise exe.error_
                for k in exe.variables:
                    if k in before:
                        continue
                    parent.variables.setdefault(k, []).append(exe.variables[k])
        for s in self.states:
            s.stream_executor.end()
