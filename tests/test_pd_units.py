"""PD disaggregation without model servers: the room rule, the transfer messages, and a
prefill scheduler and a decode scheduler (fake model, real KV pools, the real tcp
transport over loopback ZMQ sockets) that must produce a colocated scheduler's outputs,
move exactly the KV the decode lacks, and free everything on every failure path."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch

from sgl.radix import RadixTree
from sgl.runtime.disaggregation import idle_close_s
from sgl.runtime.disaggregation.decode import DecodeRole
from sgl.runtime.disaggregation.prefill import PrefillRole
from sgl.runtime.disaggregation.protocol import (Bootstrap, Cancel, Failed, KVLayout, KVReady, Pull,
                                                 decode_to_decode, decode_to_prefill, encode, tokens_hash)
from sgl.runtime.disaggregation.rooms import ROOM_MOD, BootstrapError, expand_bootstrap
from sgl.runtime.disaggregation.tcp import TcpKVReceiver, TcpKVSender
from sgl.runtime.executor.plan import StepPlan, StepResult
from sgl.runtime.memory.allocator import ReqToTokenPool, SlotAllocator
from sgl.runtime.memory.kv_pool import KVPool
from sgl.runtime.sampling_params import SamplingParams
from sgl.runtime.scheduler.kv_cache import KVCache
from sgl.runtime.scheduler.req import Req, ReqOutput
from sgl.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.fakes import EOS, CharTokenizer, FakeExecutor, expected_output
from tests.server_proc import free_port

# ---- the room rule --------------------------------------------------------------------


def rooms_of(host: Any, port: Any, room: Any, num_prompts: int, n: int) -> list[list[tuple[str, int, int]]]:
    out = expand_bootstrap(host, port, room, num_prompts, n, default_port=8998)
    assert out is not None
    return [[(b.host, b.port, b.room) for b in row] for row in out]


def test_room_rule_scalar_list_and_per_sample():
    assert rooms_of("h", 9000, 7, 1, 1) == [[("h", 9000, 7)]]
    # scalar room, n samples: room + i (wrapping below 2**63)
    assert rooms_of("h", None, 5, 1, 3) == [[("h", 8998, 5), ("h", 8998, 6), ("h", 8998, 7)]]
    assert [r for _, _, r in rooms_of("h", 1, ROOM_MOD - 1, 1, 2)[0]] == [ROOM_MOD - 1, 0]
    # one room per prompt of a batch (and + i per sample)
    assert rooms_of(["a", "b"], [1, None], [10, 20], 2, 2) == [[("a", 1, 10), ("a", 1, 11)],
                                                                [("b", 8998, 20), ("b", 8998, 21)]]
    # a chat with n choices: sglang-router sends one room per choice
    assert rooms_of(["x", "x"], [None, None], [4, 99], 1, 2) == [[("x", 8998, 4), ("x", 8998, 99)]]
    assert expand_bootstrap("h", 1, None, 1, 1, 8998) is None
    assert expand_bootstrap(None, None, [None], 1, 1, 8998) is None


@pytest.mark.parametrize("host, port, room, param", [
    ("h", 1, -1, "bootstrap_room"), ("h", 1, ROOM_MOD, "bootstrap_room"), ("h", 1, "7", "bootstrap_room"),
    ("h", 1, True, "bootstrap_room"), ("h", 1, [1, 2, 3], "bootstrap_room"), ("h", 1, [5, 5], "bootstrap_room"),
    ("", 1, 1, "bootstrap_host"), (None, 1, 1, "bootstrap_host"), ("h", 70000, 1, "bootstrap_port"),
    ("h", "80", 1, "bootstrap_port"), (["h"] * 3, 1, [1, 2], "bootstrap_host"),
])
def test_room_rule_rejects_bad_fields_naming_them(host, port, room, param):
    with pytest.raises(BootstrapError) as e:
        expand_bootstrap(host, port, room, 1, 2, 8998)
    assert e.value.param == param


def test_messages_round_trip():
    layout = KVLayout("bfloat16", 30, 3, 64)
    msgs = [Pull(2**63 - 1, 3, 10, tokens_hash([1, 2, 3]), "127.0.0.1:30000", 123),
            Cancel(5, "d:1", 2, "timeout")]
    for m in msgs:
        assert decode_to_prefill(encode(m)) == m
    back = [KVReady(9, 0, 4, layout, 17, -0.25, [(-0.25, 17), (-1.5, 3)], 2, "127.0.0.1:8998"),
            KVReady(9, 4, 4, layout, 17, None, None, 0, "p:1"), Failed(3, "boom")]
    for m in back:
        assert decode_to_decode(encode(m)) == m
    assert tokens_hash([1, 2, 3]) == tokens_hash([1, 2, 3]) != tokens_hash([1, 2, 4])
    with pytest.raises(Exception):
        decode_to_prefill(encode(Failed(1, "x")))  # a decode-bound message is not a prefill's
    # the API process -> worker request carries the sample's room
    from sgl.runtime.ipc import messages

    req = messages.Request("r", [1, 2], SamplingParams(), bootstrap=Bootstrap("localhost", 8998, 2**63 - 1))
    plain = messages.Request("s", [3], SamplingParams())
    back_req = messages.decode_to_worker(messages.encode(messages.Generate([req, plain])))
    assert [r.bootstrap for r in back_req.reqs] == [Bootstrap("localhost", 8998, 2**63 - 1), None]


# ---- a prefill and a decode scheduler over the tcp transport ----------------------------


class PoolExecutor(FakeExecutor):
    """The fake model, which also writes real KV: slot -> (token id, position) in layer 0
    of the pool (K, V). Every row's context is read back from the pool, so a sampled row
    records exactly the tokens whose KV it attended to: transferred KV included."""

    def __init__(self, req_to_token: torch.Tensor, pool: KVPool) -> None:
        super().__init__(req_to_token)
        self.pool = pool
        self.contexts: dict[int, list[int]] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        k, v = self.pool.k_buffers[0], self.pool.v_buffers[0]
        for r in plan.rows:
            table = self.req_to_token[r.req_pool_idx, : r.prefix_len].tolist()
            assert v[table, 0, 0].tolist() == list(range(r.prefix_len)), "a context slot holds another position"
            ctx = [int(t) for t in k[table, 0, 0].tolist()] + list(r.input_ids)
            for j, (tok, s) in enumerate(zip(r.input_ids, r.out_cache_loc)):
                k[s, 0, 0], v[s, 0, 0] = float(tok), float(r.prefix_len + j)
            if r.sample is not None:
                self.contexts[r.uid] = ctx
        return super().execute(plan)


def scheduler(num_slots: int = 2048) -> tuple[Scheduler, KVPool]:
    pool = KVPool(num_slots, 1, 1, 1, torch.float32)
    kv = KVCache(RadixTree(), SlotAllocator(num_slots), ReqToTokenPool(40, 1024))
    cfg = SchedulerConfig(max_running_requests=32, check_invariants_when_idle=True)
    return Scheduler(cfg, None, kv, CharTokenizer(), {EOS}, executor=PoolExecutor(kv.req_to_token.table, pool)), pool


class Pair:
    """A prefill and a decode scheduler wired as two PD workers on loopback."""

    def __init__(self, timeout: float = 5.0, port: int | None = None, decode_port: int | None = None) -> None:
        self.port = port or free_port()
        self.timeout = timeout
        self.p, pool_p = scheduler()
        self.p.attach_pd(PrefillRole(TcpKVSender("127.0.0.1", self.port, self.p.wake), pool_p, timeout))
        self.decode_port = decode_port or self.port  # where the decode's requests say the prefill is
        self.start_decode()

    def start_decode(self) -> None:
        """A decode worker starting (again: the same name, a newer incarnation, nothing
        of the old one's state; the old one vanishes without a word, as if killed)."""
        old = getattr(self, "d", None)
        if old is not None:
            old.pd.receiver.close()
        self.d, pool = scheduler()
        inc = time.time_ns()
        receiver = TcpKVReceiver("127.0.0.1:1", inc, self.d.wake, idle_close_s(self.timeout))
        self.d.attach_pd(DecodeRole(receiver, pool, self.timeout, "127.0.0.1:1", inc))

    def close(self) -> None:
        self.p.close()
        self.d.close()

    def submit(self, rid: str, prompt: list[int], max_new: int, room: int, out: dict[str, dict[str, ReqOutput]],
               to: str = "pd", **params: Any) -> None:
        p = SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0, **params})
        for side in to:
            s = self.p if side == "p" else self.d
            port = self.port if side == "p" else self.decode_port
            s.submit(Req(rid=rid, input_ids=list(prompt), params=p, bootstrap=Bootstrap("127.0.0.1", port, room),
                         on_output=lambda o, side=side: out.setdefault(side, {}).__setitem__(o.rid, o)))

    def run(self, done: Callable[[], bool], limit_s: float = 30.0) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            busy = self.p.step()
            busy = self.d.step() or busy
            for s in (self.p, self.d):
                s.check_invariants()
            if done() and not self.p.has_work() and not self.d.has_work() and self.p.inbox.empty():
                return
            if not busy:
                time.sleep(0.002)
        raise AssertionError("the PD pair did not finish")

    def assert_all_free(self) -> None:
        for s in (self.p, self.d):
            assert s.snapshot()["pd_rooms_held"] == 0
            s.check_invariants()
            assert s.kv.tree.protected_size() == 0, "a room left KV locked"
            assert s.kv.flush()
            assert s.kv.allocator.num_free == s.kv.allocator.capacity
            assert s.kv.req_to_token.num_free == s.kv.req_to_token.max_reqs


def finished(out: dict[str, dict[str, ReqOutput]], side: str, rids: list[str]) -> Callable[[], bool]:
    return lambda: all(r in out.get(side, {}) and out[side][r].finished for r in rids)


@pytest.fixture
def pair():
    pr = Pair()
    yield pr
    pr.close()


def test_pd_outputs_equal_colocated_and_second_turn_moves_only_new_tokens(pair):
    out: dict[str, dict[str, ReqOutput]] = {}
    prompts = {f"r{i}": [3 + (i * 7 + j) % 50 for j in range(20 + i * 9)] for i in range(6)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        pair.submit(rid, prompt, 8, 1000 + i, out)
    pair.run(finished(out, "d", list(prompts)))
    for rid, prompt in prompts.items():
        d, p = out["d"][rid], out["p"][rid]
        assert d.output_ids == expected_output(prompt, 8), rid
        assert d.meta_info["finish_reason"] == {"type": "length", "length": 8}
        assert p.output_ids == expected_output(prompt, 1) and p.meta_info["completion_tokens"] == 1
        m = d.meta_info
        assert m["kv_transfer_tokens"] == len(prompt) and m["decode_cached_tokens"] == 0
        assert m["prefill_worker"] == f"127.0.0.1:{pair.port}" and m["kv_transfer_bytes"] == len(prompt) * 2 * 4
    # every decode step attended to the prompt's real KV (transferred) and its own outputs
    ctxs = pair.d.executor.contexts
    assert sorted(map(tuple, ctxs.values())) == sorted(
        tuple(pr + expected_output(pr, 8)[:7]) for pr in prompts.values())
    # turn two extends turn one's prompt + answer: the decode has those, only the new tokens move
    first = prompts["r5"]
    turn2 = first + out["d"]["r5"].output_ids + [9, 10, 11]
    pair.submit("t2", turn2, 5, 77, out)
    pair.run(finished(out, "d", ["t2"]))
    m = out["d"]["t2"].meta_info
    assert out["d"]["t2"].output_ids == expected_output(turn2, 5)
    # the decode cached turn one's prompt and all but its last output token (never computed)
    assert m["decode_cached_tokens"] == len(first) + 7
    assert m["kv_transfer_tokens"] == len(turn2) - m["decode_cached_tokens"]
    assert m["cached_tokens"] == len(first)  # the prefill's own cache hit
    snap_d, snap_p = pair.d.snapshot(), pair.p.snapshot()
    assert snap_d["pd_transfers_total"] == snap_p["pd_transfers_total"] == 7
    assert snap_d["pd_transfer_tokens_total"] == sum(map(len, prompts.values())) + m["kv_transfer_tokens"]
    assert snap_d["disaggregation_mode"] == "decode" and snap_p["disaggregation_mode"] == "prefill"
    pair.assert_all_free()


def test_pull_before_request_and_n_samples_with_distinct_rooms(pair):
    out: dict[str, dict[str, ReqOutput]] = {}
    prompt = list(range(3, 40))
    rooms = expand_bootstrap("127.0.0.1", pair.port, 500, 1, 3, 8998)[0]  # n=3: rooms 500, 501, 502
    for k, b in enumerate(rooms):
        pair.submit(f"s-{k}", prompt, 6, b.room, out, to="d")  # the decode pulls before the prefill has them
    for _ in range(200):
        pair.d.step()
        pair.p.step()
        if len(pair.p.pd.early) == 3:
            break
        time.sleep(0.005)
    assert sorted(pair.p.pd.early) == [500, 501, 502]
    for k, b in enumerate(rooms):
        pair.submit(f"s-{k}", prompt, 6, b.room, out, to="p")
    pair.run(finished(out, "d", [f"s-{k}" for k in range(3)]))
    assert all(out["d"][f"s-{k}"].output_ids == expected_output(prompt, 6) for k in range(3))
    pair.assert_all_free()


def test_timeout_when_nobody_serves_the_bootstrap_port():
    pr = Pair(timeout=0.5, decode_port=free_port())  # the decode pulls from a port nobody serves
    try:
        out: dict[str, dict[str, ReqOutput]] = {}
        pr.submit("lost", list(range(3, 30)), 4, 1, out, to="d")
        pr.submit("orphan", list(range(3, 25)), 4, 2, out, to="p")  # the prefill's room is never pulled
        pr.run(lambda: finished(out, "d", ["lost"])() and finished(out, "p", ["orphan"])(), limit_s=10)
        fr = out["d"]["lost"].meta_info["finish_reason"]
        assert fr["type"] == "abort" and fr["status_code"] == 504 and "--disaggregation-timeout" in fr["message"]
        fr = out["p"]["orphan"].meta_info["finish_reason"]
        assert fr["type"] == "abort" and fr["status_code"] == 504 and "no decode worker pulled room 2" in fr["message"]
        assert pr.d.snapshot()["pd_transfer_failures_total"] == {"timeout": 1}
        assert pr.p.snapshot()["pd_transfer_failures_total"] == {"timeout": 1}
        pr.assert_all_free()
    finally:
        pr.close()


def test_prefill_abort_fails_the_decode_fast_and_frees_its_slots(pair):
    out: dict[str, dict[str, ReqOutput]] = {}
    pair.p.pd.fault = "hold_sends"  # the room is pulled but not sent
    pair.submit("a", list(range(3, 50)), 4, 42, out)
    for _ in range(500):
        pair.p.step()
        pair.d.step()
        if pair.p.pd.rooms.get(42) is not None and pair.p.pd.rooms[42].pull and pair.p.pd.rooms[42].state == "ready":
            break
        time.sleep(0.002)
    assert pair.d.kv.allocator.num_free < pair.d.kv.allocator.capacity  # slots reserved for the room
    pair.p.abort("a")
    pair.run(finished(out, "d", ["a"]))
    fr = out["d"]["a"].meta_info["finish_reason"]
    assert fr["type"] == "abort" and fr["status_code"] == 502 and "failed room 42" in fr["message"]
    assert out["p"]["a"].meta_info["finish_reason"]["type"] == "abort"
    pair.assert_all_free()


def test_decode_restart_drops_rooms_its_old_incarnation_pulled(pair):
    out: dict[str, dict[str, ReqOutput]] = {}
    pair.p.pd.fault = "hold_sends"
    pair.submit("old", list(range(3, 40)), 4, 7, out)
    for _ in range(500):
        pair.p.step()
        pair.d.step()
        r = pair.p.pd.rooms.get(7)
        if r is not None and r.pull is not None and r.state == "ready":
            break
        time.sleep(0.002)
    assert pair.p.snapshot()["pd_rooms_held"] == 1
    # the decode worker dies (its request with it) and comes back: a newer incarnation
    pair.start_decode()
    pair.submit("new", list(range(5, 30)), 4, 8, out)
    for _ in range(1000):  # still holding sends: only the new incarnation's Pull can drop the old room
        pair.p.step()
        pair.d.step()
        if "old" in out.get("p", {}):
            break
        time.sleep(0.002)
    assert pair.p.snapshot()["pd_rooms_held"] == 1 and set(pair.p.pd.rooms) == {8}
    pair.p.pd.fault = None
    pair.run(finished(out, "d", ["new"]))
    assert out["d"]["new"].output_ids == expected_output(list(range(5, 30)), 4)
    fr = out["p"]["old"].meta_info["finish_reason"]
    assert fr["type"] == "abort" and "restarted" in fr["message"]
    assert pair.p.snapshot()["pd_transfer_failures_total"].get("decode_restarted") == 1
    pair.assert_all_free()


def test_token_mismatch_fails_both_sides(pair):
    out: dict[str, dict[str, ReqOutput]] = {}
    p = SamplingParams.from_dict({"max_new_tokens": 4, "temperature": 0})
    pair.p.submit(Req("m", list(range(3, 30)), p, bootstrap=Bootstrap("127.0.0.1", pair.port, 9),
                      on_output=lambda o: out.setdefault("p", {}).__setitem__(o.rid, o)))
    pair.d.submit(Req("m", list(range(4, 31)), p, bootstrap=Bootstrap("127.0.0.1", pair.port, 9),
                      on_output=lambda o: out.setdefault("d", {}).__setitem__(o.rid, o)))
    pair.run(lambda: finished(out, "d", ["m"])() and finished(out, "p", ["m"])())
    assert out["d"]["m"].meta_info["finish_reason"]["status_code"] == 502
    assert "differ" in out["p"]["m"].meta_info["finish_reason"]["message"]
    pair.assert_all_free()


def test_prefill_bind_failure_is_clear():
    port = free_port()
    first = TcpKVSender("127.0.0.1", port, lambda: None)
    try:
        with pytest.raises(RuntimeError, match="--disaggregation-bootstrap-port"):
            TcpKVSender("127.0.0.1", port, lambda: None)
    finally:
        first.close()


@pytest.mark.parametrize("kwargs, words", [
    ({"tp_size": 2}, "--tp-size"),
    ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
    ({"disable_radix_cache": True}, "--disable-radix-cache"),
    ({"disaggregation_timeout": 0}, "--disaggregation-timeout"),
    ({"disaggregation_bootstrap_port": 70000}, "--disaggregation-bootstrap-port"),
])
def test_config_refuses_unsupported_pd_combinations(kwargs, words):
    from sgl.runtime.config import EngineConfig

    with pytest.raises(ValueError, match=words):
        EngineConfig.from_kwargs(disaggregation_mode="decode", **kwargs)
    assert EngineConfig.from_kwargs(disaggregation_mode="prefill").disaggregation_bootstrap_port == 8998


def test_empty_payload_round_trips_through_the_pool_copies():
    from sgl.runtime.disaggregation.kv_copy import as_bytes, gather, layout_of, scatter

    pool = KVPool(8, 2, 3, 4, torch.bfloat16)
    for layer in range(2):
        pool.k_buffers[layer].normal_()
        pool.v_buffers[layer].normal_()
    assert len(as_bytes(gather(pool, []))) == 0
    buf = gather(pool, [5, 2])
    other = KVPool(8, 2, 3, 4, torch.bfloat16)
    scatter(other, [1, 7], bytes(as_bytes(buf)), layout_of(pool))
    for layer in range(2):
        assert torch.equal(other.k_buffers[layer][[1, 7]], pool.k_buffers[layer][[5, 2]])
        assert torch.equal(other.v_buffers[layer][[1, 7]], pool.v_buffers[layer][[5, 2]])


def test_engine_inputs_carry_one_room_per_sample():
    from sgl.runtime.engine_io import normalize

    specs, _ = normalize(None, None, [[5, 6], [7, 8]], {"n": 2, "max_new_tokens": 3}, False, None, None, False,
                         None, 64, 100, ("h", None, [10, 20]), 9000)
    assert [(s.input_ids, s.bootstrap) for s in specs] == [
        ([5, 6], Bootstrap("h", 9000, 10)), ([5, 6], Bootstrap("h", 9000, 11)),
        ([7, 8], Bootstrap("h", 9000, 20)), ([7, 8], Bootstrap("h", 9000, 21))]
    specs, _ = normalize(None, None, [5, 6], {"max_new_tokens": 3}, False, None, None, False, None, 64, 100)
    assert specs[0].bootstrap is None


def test_prefill_gone_mid_transfer_fails_the_decode_at_once():
    pr = Pair(timeout=30)  # far longer than the test may take: the lost connection must end it
    try:
        out: dict[str, dict[str, ReqOutput]] = {}
        pr.p.pd.fault = "hold_sends"
        pr.submit("a", list(range(3, 60)), 4, 5, out)
        for _ in range(1000):
            pr.p.step()
            pr.d.step()
            r = pr.p.pd.rooms.get(5)
            if r is not None and r.pull is not None and r.state == "ready":
                break
            time.sleep(0.002)
        pr.p.pd.sender.close()  # the prefill worker dies: its socket closes
        t0 = time.monotonic()
        while "a" not in out.get("d", {}) and time.monotonic() - t0 < 10:
            pr.d.step()
            time.sleep(0.005)
        fr = out["d"]["a"].meta_info["finish_reason"]
        assert fr["status_code"] == 502 and "lost the connection" in fr["message"]
        assert pr.d.snapshot()["pd_transfer_failures_total"] == {"prefill_lost": 1}
        pr.d.check_invariants()
        assert pr.d.snapshot()["pd_rooms_held"] == 0 and pr.d.kv.tree.protected_size() == 0
        assert pr.d.kv.allocator.num_free + pr.d.kv.tree.total_size() == pr.d.kv.allocator.capacity
    finally:
        pr.d.close()


def test_default_worker_ids_name_the_machine_where_the_host_does_not():
    import socket

    from sgl.runtime.disaggregation import default_worker_id

    me = socket.gethostname()
    assert default_worker_id("prefill", "0.0.0.0", 30000) == "0.0.0.0:30000"  # binds there
    assert default_worker_id("prefill", None, None).startswith("127.0.0.1:pid")
    # decodes on two machines, both on 0.0.0.0:30000, must not look like one restarting
    assert default_worker_id("decode", "0.0.0.0", 30000) == f"{me}:30000"
    assert default_worker_id("decode", "127.0.0.1", 30001) == f"{me}:30001"
    assert default_worker_id("decode", "10.1.2.3", 30000) == "10.1.2.3:30000"
    assert default_worker_id("decode", None, None) == f"{me}:pid{__import__('os').getpid()}"


def test_a_kv_copy_that_fails_on_either_side_fails_that_request_and_frees_everything(pair, monkeypatch):
    from sgl.runtime.disaggregation import decode as decode_mod
    from sgl.runtime.disaggregation import prefill as prefill_mod

    def broken(*args, **kwargs):
        raise MemoryError("no room for the staging buffer")

    out: dict[str, dict[str, ReqOutput]] = {}
    with monkeypatch.context() as m:  # the prefill cannot read the room's KV
        m.setattr(prefill_mod, "gather", broken)
        pair.submit("g", list(range(3, 40)), 4, 61, out)
        pair.run(lambda: finished(out, "d", ["g"])() and finished(out, "p", ["g"])())
    fr_p, fr_d = out["p"]["g"].meta_info["finish_reason"], out["d"]["g"].meta_info["finish_reason"]
    assert fr_p["status_code"] == 500 and "reading room 61's KV" in fr_p["message"]
    assert fr_d["status_code"] == 502 and "failed room 61" in fr_d["message"]
    with monkeypatch.context() as m:  # the decode cannot write it
        m.setattr(decode_mod, "scatter", broken)
        pair.submit("s", list(range(4, 41)), 4, 62, out)
        pair.run(lambda: finished(out, "d", ["s"])() and finished(out, "p", ["s"])())
    fr_d = out["d"]["s"].meta_info["finish_reason"]
    assert fr_d["status_code"] == 500 and "writing room 62's KV" in fr_d["message"]
    pair.submit("ok", list(range(5, 42)), 4, 63, out)  # both workers serve on
    pair.run(finished(out, "d", ["ok"]))
    assert out["d"]["ok"].output_ids == expected_output(list(range(5, 42)), 4)
    assert pair.p.snapshot()["pd_transfer_failures_total"].get("gather_failed") == 1
    assert pair.d.snapshot()["pd_transfer_failures_total"].get("copy_failed") == 1
    pair.assert_all_free()


def test_a_pull_for_a_room_the_prefill_already_dropped_fails_at_once():
    pr = Pair(timeout=1.0)
    try:
        out: dict[str, dict[str, ReqOutput]] = {}
        pr.submit("late", list(range(3, 25)), 4, 3, out, to="p")  # nobody pulls it in time
        pr.run(finished(out, "p", ["late"]), limit_s=10)
        assert out["p"]["late"].meta_info["finish_reason"]["status_code"] == 504
        pr.submit("late", list(range(3, 25)), 4, 3, out, to="d")  # the decode asks after all
        pr.run(finished(out, "d", ["late"]), limit_s=10)
        fr = out["d"]["late"].meta_info["finish_reason"]
        assert fr["status_code"] == 502 and "failed room 3" in fr["message"]  # not a 504 after the timeout
        pr.assert_all_free()
    finally:
        pr.close()


def first_events(side: Any) -> list[Any]:
    """The first non-empty poll of a transport side (waits up to ~10 s for it)."""
    for _ in range(1000):  # a bound on waiting, not a timing assertion
        if got := side.poll():
            return got
        time.sleep(0.01)
    return []


def test_an_idle_decode_connection_is_closed_and_reopened_when_pulled_again():
    port = free_port()
    sender = TcpKVSender("127.0.0.1", port, lambda: None)
    receiver = TcpKVReceiver("127.0.0.1:2", 1, lambda: None, idle_close_s=2.0)  # > a connect on a busy host
    addr = ("127.0.0.1", port)

    def pulled(room: int) -> None:
        receiver.pull(addr, Pull(room, 0, 4, tokens_hash([1, 2, 3, 4]), "127.0.0.1:2", 1))
        assert [(type(e).__name__, e.msg.room) for e in first_events(sender)] == [("PullReceived", room)]

    try:
        pulled(1)
        assert list(receiver.dealers) == [addr]
        for _ in range(1000):
            if not receiver.dealers:
                break
            time.sleep(0.01)
        assert not receiver.dealers and not receiver.monitors and not receiver.last_used
        pulled(2)  # a later request for the same prefill opens a new connection
        assert list(receiver.dealers) == [addr]
    finally:
        receiver.close()
        sender.close()


def test_a_prefill_drops_messages_whose_sender_is_not_the_connection_they_came_on():
    import zmq

    port = free_port()
    sender = TcpKVSender("127.0.0.1", port, lambda: None)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"127.0.0.1:3|7")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        h = tokens_hash([1, 2, 3, 4])
        sock.send(encode(Cancel(9, "127.0.0.1:4", 1, "spoofed")))  # speaks for another decode worker
        sock.send(encode(Pull(9, 0, 4, h, "127.0.0.1:3", 6)))  # its own name, another incarnation
        sock.send(encode(Pull(8, 0, 4, h, "127.0.0.1:3", 7)))  # its own
        got = first_events(sender)
        time.sleep(0.2)  # nothing else follows
        got += sender.poll()
        assert [(type(e.msg).__name__, e.msg.room, e.peer) for e in got] == [("Pull", 8, b"127.0.0.1:3|7")]
    finally:
        sock.close()
        ctx.term()
        sender.close()
