"""CPU path calibration (sgl/runtime/tuning): measured once per host and cached, flags
override without measuring, a corrupt cache file is ignored and rewritten, the cache key
follows the CPU and the model, a calibration timed while other processes used the CPUs is
used but not cached, and the fp32 linear path stays within bf16 rounding of the
bf16 one with a row's bits independent of its batch."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch

from sgl.runtime.config import EngineConfig
from sgl.runtime.kernels.cpu import binding
from sgl.runtime.kernels.cpu.decode import row_limit
from sgl.runtime.kernels.cpu.linear import Fp32Weight, fp32_weight, linear
from sgl.runtime.models.llama import tiny_config, tiny_random_model
from sgl.runtime.tuning import cache as tcache
from sgl.runtime.tuning import host_load, measure
from sgl.runtime.tuning.calibrate import MARGIN, choose_paths, fastest

# Rows of the C step the flag tests ask for: 16 where the build takes them (AVX2), else the
# build's limit (8 on AVX-512), so the same tests hold on every host.
C_ROWS = min(16, row_limit(binding.kernels())) if binding.kernels() is not None else 16
CPUINFO = "model name\t: Test CPU 9000\nflags\t\t: fpu sse2 avx2 fma\n"


class CountingTimers:
    """The real timers of tuning/measure.py, each call recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        fn = getattr(measure, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return counted


def _model(**overrides):
    return tiny_random_model(tiny_config(**overrides), dtype=torch.bfloat16)


class FakeLoad:
    """Host CPU samples as a neighbour would leave them: `others` CPU-seconds of other
    processes per wall second between two samples (this process's own time is 0)."""

    def __init__(self, others: float) -> None:
        self.others, self.t = others, 0.0

    def __call__(self) -> host_load.CpuTimes:
        self.t += 1.0
        return host_load.CpuTimes(host_busy_s=self.others * self.t, own_s=0.0, wall_s=self.t)


def _choose(tmp_path, model=None, cpuinfo=CPUINFO, load=None, **flags):
    timers = CountingTimers()
    cfg = EngineConfig.from_kwargs(cache_dir=str(tmp_path), **flags)
    # A quiet host unless a test says otherwise: the suite's own neighbours must not decide.
    choice = choose_paths(cfg, model if model is not None else _model(), "cpu", timers=timers, cpuinfo=cpuinfo,
                          load=load or FakeLoad(0.0))
    return choice, timers.calls


def _cache_files(tmp_path):
    return sorted((tmp_path / "tuning").glob("paths-*.json"))


def test_second_start_reuses_the_cached_choice_without_measuring(tmp_path):
    first, calls = _choose(tmp_path)
    assert "linear_paths" in calls  # a bf16 CPU model: the linear path is always timed
    assert first.sources["linear"] == "measured" and first.linear in ("bf16", "fp32")
    assert first.timings_ms["linear"].keys() == {"bf16", "fp32"}
    [path] = _cache_files(tmp_path)
    stored = json.loads(path.read_text())
    assert stored["key"]["cpu_model"] == "Test CPU 9000" and stored["items"]["linear"]["value"] == first.linear
    second, calls = _choose(tmp_path)
    assert calls == []
    assert {k: v for k, v in second.sources.items() if v not in ("only", "default")} == \
        {k: "cache" for k, v in first.sources.items() if v == "measured"}
    assert (second.attention_backend, second.linear, second.decode_threads, second.decode_max_rows) == \
        (first.attention_backend, first.linear, first.decode_threads, first.decode_max_rows)


def test_a_calibration_timed_beside_busy_processes_is_used_but_not_cached(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="sgl.tuning"):
        busy, calls = _choose(tmp_path, load=FakeLoad(os.cpu_count() * 0.5))  # half the host's CPUs
    assert "linear_paths" in calls and busy.sources["linear"] == "busy"
    assert "measured" not in busy.sources.values() and busy.linear in ("bf16", "fp32")
    assert _cache_files(tmp_path) == []
    assert any("not cached" in r.message and "50%" in r.message for r in caplog.records)
    # The next start measures again; on a quiet host its picks are cached and then reused.
    quiet, calls = _choose(tmp_path)
    assert "linear_paths" in calls and quiet.sources["linear"] == "measured"
    assert len(_cache_files(tmp_path)) == 1
    _, calls = _choose(tmp_path, load=FakeLoad(os.cpu_count() * 0.5))
    assert calls == []  # a cached choice is not timed again, busy host or not


def test_host_load_share_counts_other_processes_only():
    before = host_load.CpuTimes(host_busy_s=100.0, own_s=10.0, wall_s=50.0)
    # 2 CPUs for 1 s: the host was busy 1.5 CPU-s, 1.0 of them this process's own
    after = host_load.CpuTimes(host_busy_s=101.5, own_s=11.0, wall_s=51.0)
    assert host_load.others_share(before, after, num_cpus=2) == pytest.approx(0.25)
    assert host_load.others_share(before, before, num_cpus=2) == 0.0  # no time passed
    assert host_load.others_share(None, after) == 0.0  # no /proc: counted as quiet
    # this process's own work is never counted as a neighbour's
    burn = host_load.CpuTimes(host_busy_s=102.0, own_s=12.0, wall_s=51.0)
    assert host_load.others_share(before, burn, num_cpus=2) == 0.0


def test_host_load_sample_reads_this_host(tmp_path):
    first = host_load.sample()
    if first is None:
        pytest.skip("no /proc/stat on this platform")
    t0 = time.process_time()
    while time.process_time() - t0 < 0.2:  # burn 0.2 s of this process's CPU
        pass
    second = host_load.sample()
    assert second.own_s - first.own_s >= 0.15
    assert second.host_busy_s - first.host_busy_s >= 0.1  # our burn is in the host's busy time too
    assert second.wall_s > first.wall_s
    assert host_load.sample(tmp_path / "missing") is None
    for garbage in ("garbage\n", "cpu 1 2 x 4 5 6 7 8\n", "cpu 1 2\n"):
        (tmp_path / "stat").write_text(garbage)
        assert host_load.sample(tmp_path / "stat") is None


def test_host_load_counts_only_the_cpus_this_process_may_use(tmp_path):
    hz = os.sysconf("SC_CLK_TCK")
    # 4 CPUs: this process is pinned to 0 and 1; a neighbour keeps CPU 3 busy
    (tmp_path / "stat").write_text(
        f"cpu {5 * hz} 0 0 0 0 0 0 0 0 0\n"
        f"cpu0 {hz} 0 0 0 0 0 0 0 0 0\ncpu1 {hz} 0 0 0 0 0 0 0 0 0\n"
        f"cpu2 0 0 0 0 0 0 0 0 0 0\ncpu3 {3 * hz} 0 0 0 0 0 0 0 0 0\nintr 1\n")
    got = host_load.sample(tmp_path / "stat", cpus={0, 1})
    assert (got.host_busy_s, got.cpus) == (2.0, 2)
    assert host_load.sample(tmp_path / "stat", cpus={3}).host_busy_s == 3.0
    everything = host_load.sample(tmp_path / "stat", cpus=set())  # no per-CPU match: the whole host
    assert (everything.host_busy_s, everything.cpus) == (5.0, 0)
    # the share is of the counted CPUs' capacity
    before = host_load.CpuTimes(0.0, 0.0, 0.0, cpus=2)
    after = host_load.CpuTimes(1.0, 0.0, 1.0, cpus=2)
    assert host_load.others_share(before, after) == pytest.approx(0.5)


def test_flags_override_and_skip_measuring(tmp_path):
    choice, calls = _choose(tmp_path, attention_backend="torch", cpu_linear="bf16", cpu_decode_threads=1,
                            cpu_decode_max_rows=str(C_ROWS))
    assert calls == []
    assert (choice.attention_backend, choice.linear, choice.decode_threads) == ("torch", "bf16", 1)
    assert set(choice.sources.values()) == {"flag"}
    assert _cache_files(tmp_path) == []  # nothing measured, nothing written
    # One flag skips only its own item.
    choice, calls = _choose(tmp_path, cpu_linear="fp32")
    assert "linear_paths" not in calls and choice.sources["linear"] == "flag" and choice.linear == "fp32"


def test_row_limit_flag_is_checked_against_the_build(tmp_path):
    kernels = binding.kernels()
    if kernels is None:
        pytest.skip("no C compiler")
    with pytest.raises(ValueError, match="cpu-decode-max-rows 1000"):
        _choose(tmp_path, cpu_decode_max_rows="1000")
    with pytest.raises(ValueError, match="cpu-decode-max-rows"):
        EngineConfig.from_kwargs(cpu_decode_max_rows="many")


@pytest.mark.parametrize("damage", ["{not json", "", '{"key": {"format": 1}, "items": {}}',
                                    '{"key": null, "items": {"linear": 3}}'])
def test_corrupt_cache_file_is_ignored_and_rewritten(tmp_path, caplog, damage):
    first, _ = _choose(tmp_path)
    [path] = _cache_files(tmp_path)
    good = json.loads(path.read_text())
    path.write_text(damage)
    with caplog.at_level(logging.WARNING, logger="sgl.tuning"):
        again, calls = _choose(tmp_path)
    assert "linear_paths" in calls and again.sources["linear"] == "measured"
    if damage:  # an empty file is as good as a truncated one: warned about too
        assert any("corrupt" in r.message for r in caplog.records)
    rewritten = json.loads(path.read_text())
    assert rewritten["key"] == good["key"] and "linear" in rewritten["items"]
    assert not list((tmp_path / "tuning").glob("*.tmp"))


def test_cache_that_is_not_text_or_has_bad_timings_is_ignored(tmp_path):
    _choose(tmp_path)
    [path] = _cache_files(tmp_path)
    good = json.loads(path.read_text())
    bad_item = {**good["items"], "linear": {"value": "bf16", "timings_ms": [1, 2]}}
    for damage in (b"\xff\xfe\x00 torn by a power loss", json.dumps({**good, "items": bad_item}).encode()):
        path.write_bytes(damage)
        again, calls = _choose(tmp_path)
        assert "linear_paths" in calls and again.sources["linear"] == "measured"


def test_a_timing_that_fails_keeps_the_default_and_the_start_goes_on(tmp_path, caplog):
    class Failing(CountingTimers):
        def __getattr__(self, name):
            if name == "linear_paths":
                def fail(*args, **kwargs):
                    raise MemoryError("no room for the fp32 copy")
                return fail
            return super().__getattr__(name)

    cfg = EngineConfig.from_kwargs(cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="sgl.tuning"):
        choice = choose_paths(cfg, _model(), "cpu", timers=Failing(), cpuinfo=CPUINFO, load=FakeLoad(0.0))
    assert choice.linear == "bf16" and choice.sources["linear"] == "default"
    assert any("timing linear failed" in r.message for r in caplog.records)
    again, calls = _choose(tmp_path)  # not cached: measured at the next start
    assert "linear_paths" in calls and again.sources["linear"] == "measured"


def test_a_model_too_short_for_the_timings_is_not_measured(tmp_path):
    choice, calls = _choose(tmp_path, model=_model(max_position_embeddings=128))
    assert calls == [] and set(choice.sources.values()) == {"default"}


def test_the_fp32_path_is_left_out_where_its_copy_would_not_fit(tmp_path, monkeypatch):
    from sgl.runtime.tuning import calibrate

    assert calibrate.fp32_fits(_model())  # a tiny model fits anywhere
    monkeypatch.setattr(calibrate, "_params", lambda model: 1 << 50)  # a model far beyond this host
    assert not calibrate.fp32_fits(_model())
    choice, calls = _choose(tmp_path)  # bf16 is the one candidate left: nothing to time
    assert (choice.linear, choice.sources["linear"]) == ("bf16", "only") and "linear_paths" not in calls


def test_key_follows_cpu_flags_and_model_shapes(tmp_path):
    _choose(tmp_path)
    _, calls = _choose(tmp_path, cpuinfo=CPUINFO.replace("avx2 fma", "avx2 fma avx512f avx512_bf16"))
    assert "linear_paths" in calls  # another CPU: measured again, in its own file
    _, calls = _choose(tmp_path, model=_model(intermediate_size=256))
    assert "linear_paths" in calls
    assert len(_cache_files(tmp_path)) == 3
    _, calls = _choose(tmp_path)
    assert calls == []
    base = tcache.key_parts(("cpu", "f1"), "b", "2.x", "s", 2)
    assert len({tcache.cache_path(tmp_path, p) for p in (
        base, {**base, "cpu_flags": "f2"}, {**base, "model_shapes": "s2"}, {**base, "threads": 1},
        {**base, "kernel_build": "c"}, {**base, "torch": "3"})}) == 6


def test_fp32_linear_path_is_within_bf16_rounding_and_batch_independent():
    g = torch.Generator().manual_seed(1)
    for out, inp in ((96, 64), (384, 128), (1000, 64)):
        w = (0.1 * torch.randn(out, inp, generator=g)).to(torch.bfloat16)
        bias = (0.1 * torch.randn(out, generator=g)).to(torch.bfloat16)
        fw = fp32_weight(w, bias)
        assert isinstance(fw, Fp32Weight) and fw.min_rows >= 32
        x = torch.randn(300, inp, generator=g).to(torch.bfloat16)
        exact = x.double() @ w.double().T + bias.double()
        got = linear(x, w, fw, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (300, out)
        # fp32 accumulation, one rounding to bf16: within one bf16 ulp (2^-8 relative) of exact.
        assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
        ref = torch.nn.functional.linear(x, w, bias)  # today's bf16 path
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -6 + 2e-2).all()
        # A row's bits do not depend on how many rows share its product, nor where it sits.
        for lo, hi in ((0, 1), (0, 2), (7, 10), (0, 6), (3, 10), (0, 11), (0, 33), (100, 300)):
            assert torch.equal(linear(x[lo:hi], w, fw, bias), got[lo:hi]), (out, inp, lo, hi)


def test_fp32_linears_model_logits_match_bf16_model_closely():
    from sgl.runtime.attention.torch_backend import TorchAttentionBackend
    from sgl.runtime.executor.forward_batch import ForwardBatch
    from sgl.runtime.memory.kv_pool import KVPool

    config = tiny_config()
    models = [tiny_random_model(config, dtype=torch.bfloat16, seed=4) for _ in range(2)]
    switched, total = models[1].use_fp32_linears()
    assert switched == total == 4 * config.num_layers + 1
    outs = []
    for m in models:
        pool = KVPool(64, config.num_layers, config.num_kv_heads, config.head_dim, torch.bfloat16)
        table = torch.arange(64, dtype=torch.int64).view(1, 64)
        ids = [(5 * i + 3) % config.vocab_size for i in range(20)]
        batch = ForwardBatch.build(ids, list(range(1, 21)), [0], [0], [20], table[:, 1:],
                                   logits_indices=list(range(20)))
        outs.append(m(batch, TorchAttentionBackend(pool)))
    bf16, fp32 = outs
    assert (fp32 - bf16).abs().max().item() < 0.05 * max(1.0, bf16.abs().max().item())
    assert (fp32.argmax(-1) == bf16.argmax(-1)).float().mean().item() >= 0.9


@pytest.fixture(scope="module")
def fp32_engine():
    from sgl.runtime.engine import Engine

    with Engine(cpu_linear="fp32", cpu_decode_max_rows=str(C_ROWS), max_total_tokens=4096) as eng:
        yield eng


def test_engine_on_fp32_linears_is_coherent_and_batch_independent(fp32_engine):
    eng = fp32_engine
    info = eng.get_server_info()["cpu_paths"]
    assert info["linear"] == "fp32" and info["sources"]["linear"] == "flag"
    c_step = binding.kernels() is not None
    if c_step:
        assert info["decode_max_rows"] == C_ROWS and info["sources"]["decode_max_rows"] == "flag"
    greedy = {"temperature": 0, "max_new_tokens": 16}
    prompt = eng.apply_chat_template([{"role": "user", "content": "Which city is the capital of France?"}])
    alone = eng.generate(prompt, greedy)
    assert "Paris" in alone["text"]
    others = [eng.apply_chat_template([{"role": "user", "content": f"Name an animal, number {i}."}])
              for i in range(C_ROWS - 1)]  # with the prompt: one full C step
    steps_before = eng.get_server_info()["cpu_decode_steps"]
    batch = eng.generate(others[:3] + [prompt] + others[3:], greedy)
    assert batch[3]["output_ids"] == alone["output_ids"]  # prefill and decode rows batched with the others
    if c_step and eng.get_server_info()["dtype"] == "bfloat16":
        assert eng.get_server_info()["cpu_decode_steps"] > steps_before  # the wide steps ran on the C step


def test_big_decode_batches_split_into_c_steps_only_where_the_c_step_won_every_count():
    from sgl.runtime.tuning.choice import PathChoice

    def choice(timings: dict[str, float]) -> PathChoice:
        return PathChoice("torch", "fp32", 2, 32, {"decode_max_rows": "measured"}, {"decode_max_rows": timings})

    assert choice({"c@16": 120.0, "torch@16": 470.0, "c@32": 210.0, "torch@32": 570.0}).decode_split
    # torch won at 32 (the rows stop at 16): big batches stay on torch
    assert not choice({"c@16": 120.0, "torch@16": 470.0, "c@32": 210.0, "torch@32": 150.0}).decode_split
    assert not choice({}).decode_split  # not measured (flag, single candidate): as before
    assert choice({"c@16": 1.0, "torch@16": 2.0}).info()["decode_split"] is True


def _with_q4_1_blocks(model):
    """The model's projections as Q4_1 GGUF blocks (gguf-py's quantizer), as the loader
    attaches them for --quantization gguf."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from sgl.runtime.models.gguf_blocks import BlockWeight, GGUFBlocks

    def q(w: torch.Tensor) -> BlockWeight:
        data = quantize(w.detach().float().numpy(), GGMLQuantizationType.Q4_1)
        return BlockWeight(int(GGMLQuantizationType.Q4_1), torch.from_numpy(np.ascontiguousarray(data)))

    layers = [{"qkv": q(l.qkv_weight), "o": q(l.o_weight), "gate_up": q(l.gate_up_weight), "down": q(l.down_weight)}
              for l in model.layers]
    model.gguf_blocks = GGUFBlocks(layers=layers, embed=None, head=None, tied=True)
    return model


def test_a_model_with_tiled_gguf_blocks_also_times_the_gguf_linear_path(tmp_path):
    from sgl.runtime.kernels.cpu.linear import TileWeight

    k = binding.kernels()
    if k is None or k.qgemm_simd() != 1:
        pytest.skip("the tiled GGUF product is a candidate only on AVX512-VNNI builds")
    model = _with_q4_1_blocks(_model())
    choice, calls = _choose(tmp_path, model)
    timings = choice.timings_ms["linear"]
    assert set(timings) == {"bf16", "fp32", "gguf"} and choice.sources["linear"] == "measured"
    assert choice.linear == min(timings, key=timings.get)
    tiled = isinstance(model.layers[0].packed.get("qkv_weight"), TileWeight)
    assert tiled == (choice.linear == "gguf")
    # the three-candidate answer is its own cache item: a model without blocks never reads it
    again, calls = _choose(tmp_path, _model())
    assert "linear_paths" in calls and set(again.timings_ms["linear"]) == {"bf16", "fp32"}


def test_gguf_linear_flag_switches_the_projections_or_falls_back(tmp_path):
    from sgl.runtime.kernels.cpu.linear import TileWeight

    model = _with_q4_1_blocks(_model())
    choice, calls = _choose(tmp_path, model, cpu_linear="gguf")
    assert "linear_paths" not in calls and choice.sources["linear"] == "flag" and choice.linear == "gguf"
    assert all(isinstance(p, TileWeight) for layer in model.layers for p in layer.packed.values())
    plain, _ = _choose(tmp_path, _model(), cpu_linear="gguf")  # no blocks: warned, bf16 GEMMs
    assert plain.linear == "bf16"


def test_key_follows_the_tuning_logic_and_the_gemm_settings(monkeypatch):
    parts = lambda: tcache.key_parts(("cpu", "flags"), "build", "2.13", "shapes", 2)  # noqa: E731
    base = parts()
    assert base == parts() and len(base["logic"]) == 16
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert parts()["kernel_env"] == {"ATEN_CPU_CAPABILITY": "avx2"} and parts() != base
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr(tcache, "_LOGIC_FILES", tcache._LOGIC_FILES[:1])  # as if the logic changed
    assert parts()["logic"] != base["logic"]


def test_one_start_at_a_time_holds_the_calibration_lock(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "tuning" / "paths-x.json"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from sgl.runtime.tuning import cache\n"
        "with cache.exclusive(Path(sys.argv[1])) as got:\n"
        "    print(got, flush=True); time.sleep(1.5)\n"), str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"  # another process is calibrating
        t0 = time.monotonic()
        with tcache.exclusive(path, wait_s=0.2) as got:  # a stuck one: go on unlocked
            assert not got and 0.2 <= time.monotonic() - t0 < 1.4
        with tcache.exclusive(path, wait_s=10) as got:  # a live one: wait for it
            assert got and time.monotonic() - t0 >= 1.0
    finally:
        holder.kill()
        holder.wait()


def test_a_candidate_replaces_the_default_only_when_clearly_faster():
    names = ["torch", "cpu"]
    assert fastest(names, {"torch": 10.0, "cpu": 10.0 * (1 - MARGIN / 2)}) == "torch"  # within the noise
    assert fastest(names, {"torch": 10.0, "cpu": 10.0 * (1 - 2 * MARGIN)}) == "cpu"
    assert fastest(names, {"torch": 10.0, "cpu": 12.0}) == "torch"
    assert fastest(names, {"cpu": 3.0}) == "cpu"  # the default could not be timed
    assert fastest(["bf16", "fp32", "gguf"], {"bf16": 10.0, "fp32": 9.0, "gguf": 9.6}) == "fp32"
