"""Triton attention kernels and backend against torch references.

Without a GPU the kernels run in Triton's CPU interpreter. Triton fixes that mode when it
is first imported, so this module sets TRITON_INTERPRET=1 before importing it; if some
earlier test module already imported triton in compiled mode, the in-process tests are
skipped and the whole file is re-run once in a fresh interpreter-mode subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from sgl.runtime.attention.registry import create_attention_backend, resolve_backend_name  # noqa: E402
from sgl.runtime.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from sgl.runtime.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from sgl.runtime.executor.forward_batch import ForwardBatch  # noqa: E402
from sgl.runtime.kernels import reference as ref  # noqa: E402
from sgl.runtime.kernels.decode_attention import choose_num_splits, decode_attention  # noqa: E402
from sgl.runtime.kernels.extend_attention import _extend_attention_kernel, extend_attention  # noqa: E402
from sgl.runtime.kernels.jit import interpreting  # noqa: E402
from sgl.runtime.kernels.rmsnorm_rope import apply_rope_, rmsnorm  # noqa: E402
from sgl.runtime.kernels.store_kv import store_kv  # noqa: E402
from sgl.runtime.memory.kv_pool import KVPool  # noqa: E402

if torch.cuda.is_available() and not interpreting(_extend_attention_kernel):
    DEVICE, STALE = "cuda", False
else:
    DEVICE = "cpu"
    # Kernels or triton's own library (tl.max, tl.sum, ...) were built in compiled mode.
    STALE = not (interpreting(_extend_attention_kernel) and interpreting(triton.language.standard.max))


@pytest.fixture(autouse=True)
def _skip_in_process_when_stale(request: pytest.FixtureRequest) -> None:
    if STALE and not request.node.name.startswith("test_subprocess_"):
        pytest.skip("triton was imported before TRITON_INTERPRET=1; covered by the subprocess test")


@pytest.mark.skipif(not STALE, reason="runs only when triton was imported in compiled mode on a CPU-only box")
def test_subprocess_kernels_in_fresh_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not test_subprocess_", __file__],
        env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.slow
def test_subprocess_kernels_compile_for_sm90(tmp_path: Path) -> None:
    """The real compiler (not the interpreter) accepts every kernel, down to a cubin."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-m", "sgl.runtime.kernels.aot_check", "90"],
        env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("compiled") == 8


# fp32 kernels match the fp32 reference to rounding; bf16 outputs are rounded to bf16
# (ulp 2**-6 for |x| in [2, 4)), and on a GPU p is also cast to bf16 before p @ V.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
if DEVICE == "cuda":  # fp32 tl.dot uses TF32 on GPUs
    TOL[torch.float32] = dict(atol=2e-3, rtol=2e-3)

NUM_SLOTS = 160
MAX_CONTEXT = 64


def _table(lens: list[int], table_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A req_to_token table with requests on shuffled rows and scattered, disjoint slots."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(len(lens) + 3, generator=g)[: len(lens)]
    slots = torch.randperm(NUM_SLOTS - 1, generator=g) + 1  # slot 0 is scratch
    table = torch.zeros(len(lens) + 3, MAX_CONTEXT, dtype=table_dtype)
    used = 0
    for r, n in zip(rows.tolist(), lens):
        table[r, :n] = slots[used : used + n].to(table_dtype)
        used += n
    return table.to(DEVICE), rows.to(DEVICE)


def _randn(*shape: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def _i64(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64, device=DEVICE)


CASES = [(dt, group, d) for dt in (torch.float32, torch.bfloat16) for group in (1, 3, 8) for d in (64, 128)]


def _ids(case: tuple) -> str:
    dt, group, d = case
    return f"{str(dt).split('.')[-1]}-g{group}-d{d}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_only_target_slots(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    kv_heads, d, t = 3, 64, 7
    k_buf, v_buf = _randn(NUM_SLOTS, kv_heads, d, dtype=dtype, g=g), _randn(NUM_SLOTS, kv_heads, d, dtype=dtype, g=g)
    # k and v as strided views of one fused projection, as the model produces them.
    fused = _randn(t, 2 * kv_heads + 1, d, dtype=dtype, g=g)
    k, v = fused[:, :kv_heads], fused[:, kv_heads + 1 :]
    loc = _i64([5, 99, 3, 150, 42, 7, 1])
    expect_k, expect_v = k_buf.clone(), v_buf.clone()
    ref.store_kv_ref(k, v, loc, expect_k, expect_v)
    store_kv(k, v, loc, k_buf, v_buf)
    assert torch.equal(k_buf, expect_k) and torch.equal(v_buf, expect_v)


def test_store_kv_casts_to_pool_dtype() -> None:
    g = torch.Generator().manual_seed(2)
    k_buf = torch.zeros(NUM_SLOTS, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    k, v = _randn(3, 2, 64, dtype=torch.float32, g=g), _randn(3, 2, 64, dtype=torch.float32, g=g)
    loc = _i64([9, 4, 77])
    store_kv(k, v, loc, k_buf, v_buf)
    # Within one bf16 ulp: the interpreter truncates fp32 -> bf16, GPUs round to nearest.
    torch.testing.assert_close(k_buf[loc].float(), k, atol=0, rtol=2**-7)
    torch.testing.assert_close(v_buf[loc].float(), v, atol=0, rtol=2**-7)
    assert k_buf.float().abs().sum() == k_buf[loc].float().abs().sum()  # nothing else written


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_extend_attention_matches_reference(case: tuple) -> None:
    dtype, group, d = case
    g = torch.Generator().manual_seed(group * 1000 + d)
    kv_heads = 2 if group < 8 else 1
    q_heads = kv_heads * group
    # Prefix lengths include 0 and 1; extends include 0, 1 and one spanning several tiles.
    prefix, extend = [0, 1, 9, 23, 0], [5, 1, 19, 0, 1]
    table_dtype = torch.int32 if d == 64 else torch.int64
    table, rows = _table([p + e for p, e in zip(prefix, extend)], table_dtype, seed=d + group)
    starts = [sum(extend[:i]) for i in range(len(extend))]
    t = sum(extend)
    k_buf = _randn(NUM_SLOTS, kv_heads, d, dtype=dtype, g=g)
    v_buf = _randn(NUM_SLOTS, kv_heads, d, dtype=dtype, g=g)
    qkv = _randn(t, q_heads + 2 * kv_heads, d, dtype=dtype, g=g)  # strided views, like the model
    q, k, v = qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads], qkv[:, q_heads + kv_heads :]
    out = torch.full((t, q_heads, d), float("nan"), dtype=dtype, device=DEVICE)
    args = (table, rows, _i64(prefix), _i64(extend), _i64(starts))
    extend_attention(q, k, v, out, k_buf, v_buf, *args, max_extend_len=max(extend))
    expected = ref.extend_attention_ref(q, k, v, k_buf, v_buf, *args)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_decode_attention_matches_reference(case: tuple) -> None:
    dtype, group, d = case
    g = torch.Generator().manual_seed(group * 7 + d)
    kv_heads = 2 if group < 8 else 1
    q_heads = kv_heads * group
    seq_lens = [1, 2, 17, 40]
    table, rows = _table(seq_lens, torch.int32, seed=group + d)
    k_buf = _randn(NUM_SLOTS, kv_heads, d, dtype=dtype, g=g)
    v_buf = _randn(NUM_SLOTS, kv_heads, d, dtype=dtype, g=g)
    q = _randn(len(seq_lens), q_heads, d, dtype=dtype, g=g)
    expected = ref.decode_attention_ref(q, k_buf, v_buf, table, rows, _i64(seq_lens))
    # One split, and five: the 1- and 2-token sequences then have empty splits.
    for num_splits in (1, 5):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, out, k_buf, v_buf, table, rows, _i64(seq_lens), num_splits)
        torch.testing.assert_close(out.float(), expected, **TOL[dtype], msg=lambda m: f"splits={num_splits}: {m}")


def test_choose_num_splits_bounds() -> None:
    assert choose_num_splits(4, 3, 10) == 1  # short sequences are not split
    assert choose_num_splits(1, 1, 100_000) == 16  # capped at max_splits
    assert choose_num_splits(1, 1, 100_000, num_sms=132, max_splits=64) == 64
    assert choose_num_splits(256, 8, 100_000, num_sms=132) == 1  # the batch already fills the GPU
    assert choose_num_splits(2, 2, 4096, num_sms=132) == 16


def _pool(dtype: torch.dtype, layers: int = 2, kv_heads: int = 2, d: int = 64) -> KVPool:
    return KVPool(NUM_SLOTS, layers, kv_heads, d, dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_torch_backend_over_steps(dtype: torch.dtype) -> None:
    """Prefill, prefix-hit extend and decode steps through ForwardBatch, on two layers."""
    g = torch.Generator().manual_seed(3)
    q_heads, kv_heads, d = 6, 2, 64
    pools = {"torch": _pool(dtype), "triton": _pool(dtype)}
    backends = {"torch": TorchAttentionBackend(pools["torch"]), "triton": TritonAttentionBackend(pools["triton"])}
    table = torch.zeros(4, MAX_CONTEXT, dtype=torch.int32, device=DEVICE)
    lens = {0: 0, 2: 0, 3: 0}  # request row -> tokens in the pool
    next_slot = [1]

    def step(extends: dict[int, int]) -> None:
        rows = list(extends)
        prefix = [lens[r] for r in rows]
        ext = [extends[r] for r in rows]
        locs: list[int] = []
        for r, e in zip(rows, ext):
            new = list(range(next_slot[0], next_slot[0] + e))
            next_slot[0] += e
            table[r, lens[r] : lens[r] + e] = torch.tensor(new, dtype=table.dtype)
            lens[r] += e
            locs += new
        t = sum(ext)
        batch = ForwardBatch.build([0] * t, locs, rows, prefix, ext, table, device=DEVICE)
        outs = {}
        for layer in range(2):
            qkv = _randn(t, q_heads + 2 * kv_heads, d, dtype=dtype, g=g)
            q, k, v = qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads], qkv[:, q_heads + kv_heads :]
            for name, backend in backends.items():
                if layer == 0:
                    backend.init_forward(batch)
                outs[name] = backend.forward(q, k, v, layer, batch)
            torch.testing.assert_close(outs["triton"].float(), outs["torch"].float(), **TOL[dtype])
        assert batch.is_decode == (all(e == 1 for e in ext) and all(p > 0 for p in prefix))

    step({0: 7, 2: 1, 3: 20})  # prefill, including a 1-token prompt
    step({0: 1, 2: 1, 3: 1})  # decode
    step({2: 4, 0: 1})  # extend onto a prefix mixed with a decode-like row
    step({0: 1, 2: 1, 3: 1})
    for layer in range(2):
        assert torch.equal(pools["torch"].k_buffers[layer], pools["triton"].k_buffers[layer])
        assert torch.equal(pools["torch"].v_buffers[layer], pools["triton"].v_buffers[layer])


def test_registry_picks_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_pool = KVPool(8, 1, 1, 16, torch.float32, device="cpu")
    assert isinstance(create_attention_backend("auto", cpu_pool), TorchAttentionBackend)
    assert isinstance(create_attention_backend(None, cpu_pool, "cpu"), TorchAttentionBackend)
    assert isinstance(create_attention_backend("torch", cpu_pool), TorchAttentionBackend)
    assert resolve_backend_name(None, "cuda") == "triton"
    assert resolve_backend_name("auto", "cpu") == "cpu"
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("flashinfer", cpu_pool)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(create_attention_backend("triton", cpu_pool), TritonAttentionBackend)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        create_attention_backend("triton", cpu_pool)


# One bf16 rounding (two for RMSNorm: normalize, then scale), possibly truncating.
NORM_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_reference(dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(11)
    hidden = 576  # SmolLM2's width: not a power of two
    x = _randn(5, hidden, dtype=dtype, g=g) * 3
    w = (1 + 0.1 * _randn(hidden, dtype=torch.float32, g=g)).to(dtype)
    residual = _randn(5, hidden, dtype=dtype, g=g) if with_residual else None
    expected, expected_res = ref.rmsnorm_ref(x, w, 1e-6, residual.clone() if residual is not None else None)
    out = rmsnorm(x, w, 1e-6, residual)
    torch.testing.assert_close(out.float(), expected.float(), **NORM_TOL[dtype])
    if residual is not None:
        assert expected_res is not None
        torch.testing.assert_close(residual.float(), expected_res.float(), **NORM_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_in_place(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(12)
    heads, kv_heads, d, max_pos = 6, 2, 64, 128
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cos, sin = freqs.cos().to(dtype).to(DEVICE), freqs.sin().to(dtype).to(DEVICE)
    positions = _i64([0, 1, 2, 77, 5, 127])
    qkv = _randn(6, heads + 2 * kv_heads, d, dtype=dtype, g=g)
    before = qkv.clone()
    qk = qkv[:, : heads + kv_heads]  # rotate q and k together, as a strided view
    expected = ref.rope_ref(qk, positions, cos, sin)
    apply_rope_(qk, positions, cos, sin)
    torch.testing.assert_close(qkv[:, : heads + kv_heads].float(), expected, **NORM_TOL[dtype])
    assert torch.equal(qkv[:, heads + kv_heads :], before[:, heads + kv_heads :])  # v untouched
    assert torch.equal(qkv[0], before[0])  # position 0 is the identity


def test_tiny_llama_logits_match_torch_backend() -> None:
    """A 2-layer random-weight Llama: prefill then decode, triton vs torch backend."""
    from sgl.runtime.models.llama import tiny_config, tiny_random_model

    config = tiny_config()
    model = tiny_random_model(config, dtype=torch.float32).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    prompts = {0: [5, 17, 3, 99, 42, 7, 8, 200, 13], 2: [1, 250]}  # request row -> prompt
    steps = [prompts] + [{r: [int(torch.randint(0, 256, (1,), generator=g))] for r in prompts} for _ in range(3)]
    runs: dict[str, list[torch.Tensor]] = {}
    for name in ("torch", "triton"):
        pool = KVPool(NUM_SLOTS, config.num_layers, config.num_kv_heads, config.head_dim, torch.float32, DEVICE)
        backend = TorchAttentionBackend(pool) if name == "torch" else TritonAttentionBackend(pool)
        table = torch.zeros(3, MAX_CONTEXT, dtype=torch.int32, device=DEVICE)
        lens = {r: 0 for r in prompts}
        next_slot, logits = 1, []
        for step in steps:
            rows, ids, locs, prefix, ext = list(step), [], [], [], []
            for r in rows:
                n = len(step[r])
                table[r, lens[r] : lens[r] + n] = torch.arange(next_slot, next_slot + n, dtype=table.dtype)
                locs += list(range(next_slot, next_slot + n))
                ids += step[r]
                prefix.append(lens[r])
                ext.append(n)
                next_slot += n
                lens[r] += n
            batch = ForwardBatch.build(ids, locs, rows, prefix, ext, table, device=DEVICE)
            logits.append(model.forward(batch, backend))
        runs[name] = logits
    for a, b in zip(runs["triton"], runs["torch"]):
        torch.testing.assert_close(a, b, **({"atol": 1e-4, "rtol": 1e-4} if DEVICE == "cpu" else {"atol": 2e-2, "rtol": 2e-2}))
