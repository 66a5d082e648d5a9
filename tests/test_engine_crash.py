"""A scheduler crash or a dead worker process reaches every caller as an error, never a
hang (issues #19, #12).

Faults are injected in the worker process through its `inject_fault` control call
(worker/serve.py), which sets `Scheduler.fault_hook`: raising at "loop" kills the loop
itself (the path a bug in the recovery code or a corrupted state would take; the worker
reports it and exits); raising at "step" is a failed step, which aborts the requests it
held while the loop lives on; "segv" is a segfault on the scheduler thread. A worker
killed with SIGKILL tells nobody: the API process must notice. Every wait here is
bounded by pytest's timeout: a hang fails the test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from sgl.runtime.engine import Engine, SchedulerCrashedError

pytestmark = pytest.mark.model

LONG = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}


def _inject(engine: Engine, point: str, once: bool = False) -> None:
    engine.workers.call("inject_fault", point, once).result(timeout=30)


def _wait_running(engine: Engine, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while engine.get_server_info()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "requests never started decoding"
        time.sleep(0.05)


def test_loop_crash_fails_every_waiting_caller_and_every_later_call():
    engine = Engine(max_total_tokens=4096)
    try:
        errors: dict[str, BaseException] = {}

        def sync_batch() -> None:
            try:
                engine.generate(["One", "Two", "Three"], LONG)
            except BaseException as e:  # noqa: BLE001 - recorded and asserted below
                errors["batch"] = e

        def sync_stream() -> None:
            try:
                for _ in engine.generate("Four", LONG, stream=True):
                    pass
            except BaseException as e:  # noqa: BLE001
                errors["stream"] = e

        async def async_both() -> None:
            try:
                await engine.async_generate("Five", LONG)
            except BaseException as e:  # noqa: BLE001
                errors["async"] = e
            try:
                async for _ in await engine.async_generate("Six", LONG, stream=True):
                    pass
            except BaseException as e:  # noqa: BLE001
                errors["async_stream"] = e

        threads = [threading.Thread(target=f) for f in (sync_batch, sync_stream,
                                                          lambda: asyncio.run(async_both()))]
        for t in threads:
            t.start()
        _inject(engine, "loop")
        for t in threads:
            t.join(timeout=120)
            assert not t.is_alive(), "a caller hung after the scheduler crashed"
        assert set(errors) == {"batch", "stream", "async", "async_stream"}, errors
        for e in errors.values():
            assert isinstance(e, SchedulerCrashedError), repr(e)
            assert "injected fault" in str(e) and "create a new Engine" in str(e)
        with pytest.raises(SchedulerCrashedError, match="injected fault"):
            engine.generate("after the crash", {"max_new_tokens": 2})
        with pytest.raises(SchedulerCrashedError):
            engine.get_server_info()
    finally:
        engine.shutdown()  # returns although the loop is gone


def test_killed_worker_fails_every_caller_and_leaves_no_process():
    """SIGKILL tells nobody: the API process notices the exit and names it."""
    engine = Engine(max_total_tokens=4096)
    pids = engine.workers.alive_pids()
    try:
        errors: list[BaseException] = []

        def stream() -> None:
            try:
                for _ in engine.generate("Seven", LONG, stream=True):
                    pass
            except BaseException as e:  # noqa: BLE001 - asserted below
                errors.append(e)

        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
        _wait_running(engine)
        t0 = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive(), "a caller hung after the worker was killed"
        assert time.monotonic() - t0 < 10
        assert len(errors) == 3 and all(isinstance(e, SchedulerCrashedError) for e in errors), errors
        assert "SIGKILL" in str(errors[0])
        with pytest.raises(SchedulerCrashedError, match="SIGKILL"):
            engine.generate("after", {"max_new_tokens": 2})
    finally:
        engine.shutdown()
    assert engine.workers.alive_pids() == []


def test_failed_step_aborts_its_requests_frees_kv_and_serving_goes_on(engine):
    engine.flush_cache()
    _inject(engine, "step", once=True)
    try:
        outs = engine.generate(["Eight", "Nine"], LONG)
    finally:
        engine.workers.call("clear_fault").result(timeout=30)
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs), [o["meta_info"] for o in outs]
    assert "internal error" in outs[0]["meta_info"]["finish_reason"]["message"]
    again = engine.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0})
    assert again["meta_info"]["finish_reason"]["type"] == "length"
    engine.check_invariants()
    info = engine.get_server_info()
    assert info["kv_used_tokens"] == info["kv_evictable_tokens"]  # only the tree's cached prefixes


def test_http_server_answers_5xx_with_the_cause_and_health_fails():
    from sgl.server.app import create_app

    engine = Engine(max_total_tokens=4096)
    app = create_app(engine, served_model_name="smol")

    async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sgl") as client:
            ok = await client.get("/health")
            assert ok.status_code == 200
            await asyncio.to_thread(_inject, engine, "loop")
            gen = await client.post("/generate", json={"text": "Ten", "sampling_params": LONG}, timeout=120)
            chat = await client.post("/v1/chat/completions", timeout=120, json={
                "model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
            health = await client.get("/health")
            return gen, chat, health

    try:
        gen, chat, health = asyncio.run(go())
    finally:
        engine.shutdown()
    assert gen.status_code >= 500 and "injected fault" in gen.json()["error"]["message"], gen.text
    assert chat.status_code >= 500 and "scheduler crashed" in chat.json()["error"]["message"], chat.text
    assert health.status_code == 503 and "injected fault" in health.text


def test_fatal_signal_in_the_worker_leaves_its_stack_and_reaches_the_caller():
    """A segfault in native code cannot be turned into an exception; what the worker can
    do is leave the evidence (faulthandler prints every thread's Python stack), and the
    API process turns the death into an error naming the signal."""
    import subprocess
    import sys

    script = (
        "from sgl.runtime.engine import Engine, SchedulerCrashedError\n"
        "e = Engine(max_total_tokens=1024)\n"
        "e.workers.call('inject_fault', 'segv', True).result()\n"
        "try:\n"
        "    e.generate('Eleven', {'max_new_tokens': 50, 'ignore_eos': True})\n"
        "except SchedulerCrashedError as err:\n"
        "    print('CAUGHT', err)\n"
        "e.shutdown()\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CAUGHT" in r.stdout and "SIGSEGV" in r.stdout, r.stdout
    assert "Segmentation fault" in r.stderr, r.stderr[-2000:]
    assert "run_forever" in r.stderr and "hook" in r.stderr, r.stderr[-2000:]  # the faulting thread's stack
