"""Role turns and variable scopes as written on a state: `s.user(...)`, `with s.assistant():`.

The running state (state.py) and the tracer's state (tracer.py) write the same nodes and
differ only in what writing one means (queue it for the interpreter, or record it), so
both inherit these methods and supply `_write`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from sgl.lang.ir import SglExpr, SglRoleBegin, SglRoleEnd, SglVarScopeBegin, SglVarScopeEnd, role_exprs


class RoleWriter:
    def _write(self, expr: SglExpr) -> None:
        raise NotImplementedError

    def _role(self, name: str, expr: Any = None):
        """With `expr`: append the whole turn now. Without: a context manager around the turn."""
        if expr is not None:
            self._write(role_exprs(name, expr))
            return None
        return self._role_scope(name)

    @contextmanager
    def _role_scope(self, name: str) -> Iterator[None]:
        self._write(SglRoleBegin(name))
        yield
        self._write(SglRoleEnd(name))

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block becomes variable `name`."""
        self._write(SglVarScopeBegin(name))
        yield
        self._write(SglVarScopeEnd(name))
