"""A scheduler crash reaches every caller as an error, never a hang (issue #19).

Faults are injected through `Scheduler.fault_hook`: raising at "loop" kills the loop
itself (the path a bug in the recovery code or a corrupted state would take); raising
at "step" is a failed step, which aborts the requests it held while the loop lives on.
Every wait here is bounded by pytest's timeout: a hang fails the test.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from sgl.runtime.engine import Engine, SchedulerCrashedError

pytestmark = pytest.mark.model

LONG = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}


def _crash_when_running(engine: Engine, point: str, once: bool = False):
    """A hook that raises at `point` once requests are decoding."""
    fired: list[bool] = []

    def hook(where: str) -> None:
        if where == point and engine.scheduler.running and not (once and fired):
            fired.append(True)
            raise RuntimeError("injected fault")

    return hook


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
        engine.scheduler.fault_hook = _crash_when_running(engine, "loop")
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


def test_thread_death_that_notifies_nobody_still_reaches_the_caller(monkeypatch):
    engine = Engine(max_total_tokens=4096)
    try:
        # The crash handler itself is broken: no request is finished, nobody is told.
        monkeypatch.setattr(engine.scheduler, "_fail_everything", lambda exc: None)
        engine.scheduler.fault_hook = _crash_when_running(engine, "loop")
        with pytest.raises(SchedulerCrashedError, match="thread exited"):
            engine.generate("Seven", LONG)
    finally:
        engine.shutdown()


def test_failed_step_aborts_its_requests_frees_kv_and_serving_goes_on(engine):
    engine.flush_cache()
    engine.scheduler.fault_hook = _crash_when_running(engine, "step", once=True)
    try:
        outs = engine.generate(["Eight", "Nine"], LONG)
    finally:
        engine.scheduler.fault_hook = None
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
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
            engine.scheduler.fault_hook = _crash_when_running(engine, "loop")
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


def test_fatal_signal_in_the_scheduler_thread_leaves_its_stack_on_stderr():
    """A segfault in native code cannot be turned into an exception; what the engine can
    do is leave the evidence: faulthandler prints every thread's Python stack."""
    import subprocess
    import sys

    script = (
        "import ctypes\n"
        "from sgl.runtime.engine import Engine\n"
        "e = Engine(max_total_tokens=1024)\n"
        "def hook(where):\n"
        "    if where == 'step' and e.scheduler.running:\n"
        "        ctypes.string_at(0)  # a read of address 0: SIGSEGV on the scheduler thread\n"
        "e.scheduler.fault_hook = hook\n"
        "e.generate('Eleven', {'max_new_tokens': 50, 'ignore_eos': True})\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "Segmentation fault" in r.stderr, r.stderr[-2000:]
    assert "run_forever" in r.stderr and "hook" in r.stderr, r.stderr[-2000:]  # the faulting thread's stack
