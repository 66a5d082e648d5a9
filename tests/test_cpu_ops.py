"""The fused CPU ops (kernels/cpu/ops.c via kernels/cpu/ops.py) against the torch
expressions they replace, and the bf16 model forward with them against the plain torch ops.

Op level, on random bf16 inputs with odd row counts and hidden sizes 64 / 72 / 576 (and
100, a masked tail), on one and two threads, native and portable (non-AVX512) builds:
residual adds, RoPE and SiLU*up give the same bits as torch, and so do the norms, whose
sum of squares is added in the order of torch's CPU float sum (see ops.c). Should torch
change that order, the norms would differ by 1 ulp on ~1 value in 10^5: the checks allow
none. Model level: tiny random models (ragged prefill + extend batches, a 9-row decode
batch) and the embedded SmolLM2 (250-token prefills: last-token logits and greedy next
tokens) with the ops on vs SGL_DISABLE_CPU_OPS=1: identical logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgl.runtime.attention.torch_backend import TorchAttentionBackend
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.memory.kv_pool import KVPool
from sgl.runtime.kernels.cpu import binding
from sgl.runtime.kernels.cpu import ops as cpu_ops
from sgl.runtime.models.llama import tiny_config, tiny_random_model
from sgl.runtime.models.loader import load_model

pytestmark = pytest.mark.skipif(cpu_ops.library() is None, reason="no C compiler for the CPU kernels")

BF = torch.bfloat16
EPS = 1e-5


def _assert_same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    ulps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert torch.equal(out, ref), f"{int((ulps > 0).sum())} of {ref.numel()} differ, by up to {int(ulps.max())} ulp"


def _norm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, EPS).to(BF)


@pytest.fixture(params=["native", "portable"])
def lib(request, monkeypatch) -> binding.Kernels:
    """The library the wrappers call: the native build, or the plain-C one (x86-64-v2)."""
    if request.param == "native":
        return cpu_ops.library()
    portable = binding.kernels("x86-64-v2")
    if portable is None:
        pytest.skip("cannot build the portable variant here")
    monkeypatch.setattr(cpu_ops, "_lib", portable)
    assert not portable.ops_simd()
    return portable


SHAPES = [(1, 64), (7, 72), (33, 576), (257, 576), (5, 100)]  # 257 x 576 is above the two-thread split size


@pytest.mark.parametrize("rows,n", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_rmsnorm_and_add_rmsnorm(lib, rows, n, threads):
    g = torch.Generator().manual_seed(rows * n)
    x = (3 * torch.randn(rows, n, generator=g)).to(BF)
    y = torch.randn(rows, n, generator=g).to(BF)
    w = (1 + 0.2 * torch.randn(n, generator=g)).to(BF)
    _assert_same_bits(cpu_ops.rmsnorm(x, w, EPS, threads), _norm_ref(x, w))
    xs = x.clone()
    out = cpu_ops.add_rmsnorm(xs, y, w, EPS, threads)
    assert torch.equal(xs, x + y)  # the residual is updated in place, rounded as torch's add
    _assert_same_bits(out, _norm_ref(x + y, w))
    xs = x.clone()  # the C entry point without an output: the add alone
    lib.add_rmsnorm(xs.data_ptr(), y.data_ptr(), w.data_ptr(), None, rows, n, EPS, threads)
    assert torch.equal(xs, x + y)


@pytest.mark.parametrize("rows,n", [(1, 64), (7, 72), (33, 576), (257, 100)])
@pytest.mark.parametrize("threads", [1, 2])
def test_silu_mul(lib, rows, n, threads):
    g = torch.Generator().manual_seed(rows + n)
    gu = (4 * torch.randn(rows, 2 * n, generator=g)).to(BF)
    gu[0, :4] = torch.tensor([-120.0, 95.0, 0.0, -0.0])  # the exp clamp, and signed zeros
    gate, up = gu.chunk(2, dim=-1)
    _assert_same_bits(cpu_ops.silu_mul(gu, threads), F.silu(gate) * up)


@pytest.mark.parametrize("t,heads,d", [(1, 12, 64), (37, 4, 24), (301, 12, 64), (5, 3, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rope_in_place_on_qk_heads(lib, t, heads, d, threads):
    g = torch.Generator().manual_seed(t * d)
    kv = 2
    qkv = torch.randn(t, (heads + kv) * d, generator=g).to(BF)  # heads (q + k) then kv v-heads
    pos = torch.randint(0, 900, (t,), generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(1024, dtype=torch.float32), inv)
    cos, sin = freqs.cos().to(BF), freqs.sin().to(BF)
    qk = qkv[:, : heads * d].view(t, heads, 2, d // 2)  # the torch path's expression
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    ref = (qk * torch.stack((c, c), dim=2) + qk.flip(2) * torch.stack((-s, s), dim=2)).view(t, heads * d)
    out = qkv.clone()
    assert cpu_ops.rope_(out, pos, cos, sin, heads, d, threads) is out
    _assert_same_bits(out[:, : heads * d], ref)
    assert torch.equal(out[:, heads * d :], qkv[:, heads * d :])  # v untouched
    bad = pos.clone()
    bad[-1] = 1024
    with pytest.raises(IndexError):
        cpu_ops.rope_(out, bad, cos, sin, heads, d, threads)


def test_fallbacks_compute_the_torch_expressions(monkeypatch):
    x = torch.randn(5, 64)
    w = torch.rand(64) + 0.5
    assert not cpu_ops.applies(x)  # float32 keeps torch
    assert torch.equal(cpu_ops.rmsnorm(x, w, EPS), w * F.rms_norm(x, (64,), None, EPS))
    xb = x.to(BF)
    assert cpu_ops.applies(xb)
    monkeypatch.setenv("SGL_DISABLE_CPU_OPS", "1")
    assert not cpu_ops.applies(xb)
    gu = torch.randn(3, 128).to(BF)
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(cpu_ops.silu_mul(gu), F.silu(gate) * up)


def _forward_both(model, batch_fn, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the same step with the ops off and on (fresh pool each, same contents)."""
    calls = []
    fused = cpu_ops.silu_mul
    monkeypatch.setattr(cpu_ops, "silu_mul", lambda *a, **k: calls.append(1) or fused(*a, **k))
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("SGL_DISABLE_CPU_OPS", flag)
        outs.append(batch_fn(model))
        if flag == "1":
            assert not calls  # the plain torch path
    assert calls  # the fused path ran
    return outs[0], outs[1]


def _ragged_steps(model) -> torch.Tensor:
    """Prefill two requests (logits rows out of order), extend one of them, then decode a
    batch of 9 (past the decode kernel's 8 rows; its logits rows reversed): all logits."""
    c = model.config
    pool = KVPool(1024, c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
    attn = TorchAttentionBackend(pool)
    r2t = torch.zeros(12, 256, dtype=torch.int64)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, c.vocab_size, (400,), generator=g).tolist()
    r2t[0, :60] = torch.arange(1, 61)
    r2t[1, :33] = torch.arange(61, 94)
    pre = ForwardBatch.build(ids[:50] + ids[50:83], list(range(1, 51)) + list(range(61, 94)), [0, 1], [0, 0],
                             [50, 33], r2t, logits_indices=[82, 10, 49, 10])  # any order, repeats
    ext = ForwardBatch.build(ids[83:93], list(range(51, 61)), [0], [50], [10], r2t)
    out = [model(pre, attn), model(ext, attn)]
    rows, locs = [], []
    for i in range(9):  # each decodes one token after the 60 of request 0 (shared prefix)
        r = 2 + i
        r2t[r, :60] = r2t[0, :60]
        r2t[r, 60] = 100 + i
        rows.append(r)
        locs.append(100 + i)
    dec = ForwardBatch.build(ids[100:109], locs, rows, [60] * 9, [1] * 9, r2t, logits_indices=list(range(8, -1, -1)))
    out.append(model(dec, attn))
    return torch.cat(out)


@pytest.mark.parametrize("overrides", [{}, dict(hidden_size=72, num_heads=3, num_kv_heads=1, head_dim=24,
                                                intermediate_size=100, vocab_size=300, attention_bias=True)])
def test_tiny_model_ragged_batches_match_torch_path(overrides, monkeypatch):
    model = tiny_random_model(tiny_config(**overrides), dtype=BF, seed=3)
    model.prepack()
    ref, out = _forward_both(model, _ragged_steps, monkeypatch)
    assert out.shape == ref.shape == (4 + 1 + 9, model.config.vocab_size)
    assert torch.equal(out, ref)


@pytest.fixture(scope="module")
def real():
    return load_model(dtype="bfloat16")


PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "def merge_sort(items):\n    \"\"\"Sort a list with merge sort.\"\"\"\n",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
]


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    c = model.config
    pool = KVPool(len(ids) + 8, c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
    attn = TorchAttentionBackend(pool)
    r2t = torch.arange(1, len(ids) + 1, dtype=torch.int64)[None]
    return model(ForwardBatch.build(ids, r2t[0].tolist(), [0], [0], [len(ids)], r2t), attn)[0]


@pytest.mark.model
def test_real_model_prefill_logits_and_greedy_tokens(real, monkeypatch):
    """250-token prefills (filler text, then the prompt): the same last-token logits and so
    the same greedy next token. (The tolerance is zero: the ops round as torch does.)"""
    model, tok = real.model, real.tokenizer
    filler = tok.encode("We write down what we see, and we check it twice before we move on. " * 30)
    for prompt in PROMPTS:
        ids = (filler + tok.encode(prompt))[-250:]
        ref, out = _forward_both(model, lambda m: _prefill_logits(m, ids), monkeypatch)
        assert (out - ref).abs().max().item() == 0.0
        assert int(out.argmax()) == int(ref.argmax())
