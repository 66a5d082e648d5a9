"""Running programs: one (`fn.run`), streamed, or a batch on a thread pool (`fn.run_batch`).

A batch first warms the radix cache with the programs' common constant prefix, found by
tracing the program with placeholder arguments, so the threads that start together all
find the few-shot examples already cached instead of prefilling them side by side.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sgl.lang.backends import as_backend
from sgl.lang.backends.base import Backend
from sgl.lang.global_config import global_config
from sgl.lang.interpreter import ProgramError, StreamExecutor
from sgl.lang.ir import GenParams
from sgl.lang.state import ProgramState
from sgl.lang.tracer import Program, extract_prefix_by_tracing


def _resolve(backend: Any) -> Backend:
    if backend is None:
        raise ValueError("no backend: call sgl.set_default_backend(...) or pass backend= to run()")
    return as_backend(backend)


def _body(state: ProgramState, program: Program, args: tuple, kwargs: dict) -> None:
    exe = state.stream_executor
    try:
        state.ret_value = program.func(state, *args, **kwargs)
    except ProgramError as e:
        e.state = state
        raise
    except BaseException as e:
        if exe.stream and exe.error_ is None:
            exe._fail("the program body", e)
        raise
    finally:
        exe.end()
    exe.sync()
    if exe.error_ is not None:
        exe.error_.state = state
        raise exe.error_
    if global_config.verbosity >= 2:
        print(exe.text_)


def run_program(program: Program, backend: Any, args: tuple, kwargs: dict, params: GenParams,
                stream: bool) -> ProgramState:
    kwargs = {**kwargs, **program.bind_arguments}
    exe = StreamExecutor(_resolve(backend), kwargs, params, stream=stream, program_name=program.__name__)
    state = ProgramState(exe)
    if not stream:
        _body(state, program, args, kwargs)
        return state

    def quiet() -> None:
        try:
            _body(state, program, args, kwargs)
        except BaseException:  # noqa: BLE001 - surfaced by text_iter / error()
            pass

    threading.Thread(target=quiet, name=f"sgl-stream-{program.__name__}", daemon=True).start()
    return state


def cache_program(program: Program, backend: Any) -> str:
    """Prefill the program's constant prefix; returns it ("" when too short to bother)."""
    backend = _resolve(backend)
    prefix = extract_prefix_by_tracing(program, backend)
    if len(prefix) > global_config.precache_min_chars:
        backend.cache_prefix(prefix)
        return prefix
    return ""


def run_program_batch(program: Program, backend: Any, batch: list[dict], params: GenParams,
                      num_threads: str | int, progress_bar: bool) -> list[ProgramState]:
    return list(iter_program_batch(program, backend, batch, params, num_threads, progress_bar))


def iter_program_batch(program: Program, backend: Any, batch: list[dict], params: GenParams,
                       num_threads: str | int, progress_bar: bool) -> Iterator[ProgramState]:
    """The batch's states in input order, each as soon as it and those before it are done;
    after the last, a ProgramError if any program failed (its `states` hold them all)."""
    backend = _resolve(backend)
    if global_config.enable_precache_with_tracing and len(batch) > 1:
        cache_program(program, backend)
    if num_threads == "auto":
        num_threads = 128
    num_threads = max(1, min(int(num_threads), len(batch)))

    def one(kw: dict) -> ProgramState | ProgramError:
        try:
            return run_program(program, backend, (), kw, params, False)
        except ProgramError as e:
            return e

    pbar = None
    if progress_bar:
        import tqdm

        pbar = tqdm.tqdm(total=len(batch))
    states: list[ProgramState] = []
    errors: list[ProgramError] = []
    with ThreadPoolExecutor(num_threads) as pool:
        futures = [pool.submit(one, kw) for kw in batch]
        if pbar is not None:
            for f in futures:
                f.add_done_callback(lambda _: pbar.update())
        for f in futures:
            o = f.result()
            if isinstance(o, ProgramError):
                errors.append(o)
            states.append(o.state if isinstance(o, ProgramError) else o)
            yield states[-1]
    if pbar is not None:
        pbar.close()
    if errors:
        err = ProgramError(f"{len(errors)} of {len(batch)} programs in run_batch failed; first: {errors[0]}")
        err.__cause__ = errors[0]
        err.states = states
        err.state = errors[0].state
        raise err
