"""The C attention kernel (kernels/cpu/attention.c) against a float32 reference and the
torch backend: mixed prefill / extend / decode batches, shared prefixes, GQA ratios 1, 3
and 8, head dims 64 and 128, one and two threads."""

from __future__ import annotations

import pytest
import torch

from sgl.runtime.attention import cpu_backend
from sgl.runtime.attention.cpu_backend import CpuAttentionBackend
from sgl.runtime.attention.torch_backend import TorchAttentionBackend
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.memory.kv_pool import KVPool

from tests.attention_helpers import pool_and_batch

pytestmark = pytest.mark.skipif(not cpu_backend.kernel_supported(KVPool(8, 1, 1, 64, torch.bfloat16)),
                                reason="needs a C compiler and AVX512-BF16")


def _case(shared: int, cached: list[int], extend: list[int], kv: int, group: int, d: int, seed: int = 0):
    # Scores of a realistic spread (|q.k| * scale up to ~10): softmaxes neither flat nor one-hot.
    return pool_and_batch(shared, cached, extend, kv, group, d, seed=seed, q_scale=2.0)


def _reference(pool: KVPool, fb: ForwardBatch, q: torch.Tensor) -> torch.Tensor:
    """float32 attention from the pool (after the K/V write), request by request."""
    kb, vb = pool.k_buffers[0].float(), pool.v_buffers[0].float()
    out = torch.empty(q.shape, dtype=torch.float32)
    h, kv = q.shape[1], kb.shape[1]
    start = 0
    for r, p, e in zip(fb.req_pool_indices.tolist(), fb.prefix_lens_cpu, fb.extend_lens_cpu):
        slots = fb.req_to_token[r, : p + e]
        keys = kb[slots].repeat_interleave(h // kv, 1).transpose(0, 1)  # [H, S, D]
        vals = vb[slots].repeat_interleave(h // kv, 1).transpose(0, 1)
        qi = q[start : start + e].float().transpose(0, 1)  # [H, e, D]
        s = qi @ keys.transpose(1, 2) * q.shape[-1] ** -0.5
        visible = torch.arange(p + e)[None, :] <= torch.arange(p, p + e)[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        out[start : start + e] = (torch.softmax(s, -1) @ vals).transpose(0, 1)
        start += e
    return out


def _run(backend_cls, pool, fb, q, k, v, threads: int = 2) -> torch.Tensor:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        b = backend_cls(pool)
        b.init_forward(fb)
        return b.forward(q, k, v, 0, fb)
    finally:
        torch.set_num_threads(old)


CASES = [
    (0, [0], [1]),  # a one-token prompt
    (0, [0], [200]),  # a plain prefill: several token blocks and key steps
    (0, [0, 5, 40, 0], [33, 1, 17, 2]),  # mixed prefill / extend / decode rows
    (0, [3, 70, 0, 129], [1, 1, 1, 1]),  # a decode batch without a shared prefix
    (70, [0, 3, 7, 1, 0], [1, 1, 1, 1, 1]),  # decode rows over a shared prefix
    (96, [0, 5, 0], [20, 1, 47]),  # extends after a shared prefix (the suffix prefill)
]


@pytest.mark.parametrize("shared, cached, extend", CASES)
@pytest.mark.parametrize("kv, group, d", [(3, 3, 64), (2, 1, 64), (1, 8, 64), (2, 3, 128)])
def test_matches_float32_reference(shared: int, cached: list[int], extend: list[int], kv: int, group: int,
                                   d: int) -> None:
    pool, fb, q, k, v = _case(shared, cached, extend, kv, group, d)
    ours = _run(CpuAttentionBackend, pool, fb, q, k, v)
    assert ours.dtype == torch.bfloat16 and ours.shape == q.shape
    ref = _reference(pool, fb, q)
    torch_bf16 = _run(TorchAttentionBackend, pool, fb, q, k, v).float()
    err, err_torch = (ours.float() - ref).abs(), (torch_bf16 - ref).abs()
    # bf16 output rounding alone is up to ~4e-3 relative; probabilities rounded to bf16
    # for the value products add a few 1e-3 absolute on these magnitudes.
    assert err.max().item() < 3e-2
    assert err.mean().item() <= 1.5 * err_torch.mean().item() + 1e-4


def test_threads_give_identical_bits() -> None:
    pool, fb, q, k, v = _case(64, [0, 9, 2], [40, 1, 13], 3, 3, 64, seed=3)
    one = _run(CpuAttentionBackend, pool, fb, q, k, v, threads=1)
    two = _run(CpuAttentionBackend, pool, fb, q, k, v, threads=2)
    assert torch.equal(one, two)


def test_kv_written_to_pool() -> None:
    pool, fb, q, k, v = _case(0, [4, 0], [3, 5], 3, 3, 64, seed=5)
    _run(CpuAttentionBackend, pool, fb, q, k, v)
    assert torch.equal(pool.k_buffers[0][fb.out_cache_loc], k)
    assert torch.equal(pool.v_buffers[0][fb.out_cache_loc], v)


def test_unsupported_pools_use_torch() -> None:
    fp32 = KVPool(64, 1, 2, 64, torch.float32)
    odd = KVPool(64, 1, 2, 48, torch.bfloat16)
    assert not cpu_backend.kernel_supported(fp32) and not cpu_backend.kernel_supported(odd)
    assert CpuAttentionBackend(fp32).lib is None and CpuAttentionBackend(odd).lib is None


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGL_DISABLE_CPU_ATTENTION", "1")
    assert not cpu_backend.kernel_supported(KVPool(64, 1, 2, 64, torch.bfloat16))


@pytest.mark.model
def test_real_model_prefill_is_as_close_to_float32_as_torch() -> None:
    """Prefill + extend of the embedded model: last-token logits through the C kernel are
    about as far from the float32 model as the torch bf16 path's, and pick the same token."""
    from sgl.runtime.models.loader import load_model

    def logits(model, backend_cls) -> torch.Tensor:
        c = model.config
        pool = KVPool(2048, c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
        attn = backend_cls(pool)
        table = torch.zeros(4, 1024, dtype=torch.int64)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, c.vocab_size, (n,), generator=g).tolist() for n in (300, 90)]
        table[0, :300] = torch.arange(1, 301)
        table[1, :90] = torch.arange(301, 391)
        first = ForwardBatch.build(prompts[0] + prompts[1][:60], list(range(1, 301)) + list(range(301, 361)),
                                   [0, 1], [0, 0], [300, 60], table)
        a = model(first, attn)
        # Request 1 extends its cached 60 tokens by 30 (prefix + causal mask), request 0 decodes.
        second = ForwardBatch.build([prompts[0][-1]] + prompts[1][60:], [300] + list(range(361, 391)), [0, 1],
                                    [299, 60], [1, 30], table)
        return torch.cat((a, model(second, attn)))

    bf16, fp32 = load_model(dtype="bfloat16").model, load_model(dtype="float32").model
    ours, theirs, exact = logits(bf16, CpuAttentionBackend), logits(bf16, TorchAttentionBackend), logits(
        fp32, TorchAttentionBackend)

    def rms(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a - b).pow(2).mean().sqrt().item()

    print(f"rms vs float32: C kernel {rms(ours, exact):.4f}, torch bf16 {rms(theirs, exact):.4f}")
    assert rms(ours, exact) <= 1.5 * rms(theirs, exact) + 0.05, (rms(ours, exact), rms(theirs, exact))
    tol = 0.04 * exact.abs().max().item()
    for r in range(ours.shape[0]):
        pick = int(ours[r].argmax())
        assert exact[r, pick] >= exact[r].max() - tol


def test_registry_picks_the_kernel_on_cpu_where_it_applies() -> None:
    from sgl.runtime.attention.registry import create_attention_backend

    bf16, fp32 = KVPool(64, 1, 2, 64, torch.bfloat16), KVPool(64, 1, 2, 64, torch.float32)
    assert type(create_attention_backend("auto", bf16)) is CpuAttentionBackend
    assert type(create_attention_backend(None, fp32)) is TorchAttentionBackend
    assert type(create_attention_backend("cpu", fp32)) is TorchAttentionBackend  # with a warning
    assert type(create_attention_backend("torch", bf16)) is TorchAttentionBackend
