"""Decode steps of a bf16 Llama-family model through the C kernel (decode.c, bound in binding.py).

For a decode batch of at most `MAX_ROWS` new tokens on the CPU, the whole forward is
one C call that reads the weights and the KV pool in place (through a table of their
addresses) and writes float32 logits: the ~700 torch ops of an eager step cost more than
the weight streaming they wrap at batch 1. The model runner (executor/model_runner.py)
decides when to use it; anything else keeps the model's torch forward. `threads` 2
splits the products over the caller and team.c's helper thread.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.kernels.cpu import binding
from sgl.runtime.kernels.cpu.binding import DecodeBatch, DecodeModel, Kernels, Status, WeightType

# Batch sizes up to this stream the weights once for all rows (batch 8 with two threads:
# 24 ms per step vs 31 for torch); past it the arithmetic outgrows the streaming and
# oneDNN's GEMMs win where bf16 GEMMs have hardware. The default: runtime/tuning measures
# the limit per host (`max_rows`), up to what the build allows (`row_limit`).
MAX_ROWS = 8
# Most new tokens one request may bring to a batch that is split into several steps: a
# decode token, speculative drafts; longer extends are prefill work (CpuDecoder.supports).
SPLIT_EXTEND = 8
# The AVX2 step sums every row alike whatever the batch (groups of 3 rows); the
# AVX512-BF16 one only up to 8 rows (its register tile), the plain-C one alike but slowly.
AVX2_ROW_LIMIT = 64

log = logging.getLogger("sgl.kernels")


def default_threads() -> int:
    """1 or 2: two when torch has two or more threads.

    Two read ~25-30 GB/s where one reads ~16-22 (batch-1 step ~10 vs ~14 ms measured
    side by side), but the helper spins during a step, which costs more than it gains
    when other busy processes want the cores: there, configure 1."""
    return 2 if torch.get_num_threads() >= 2 else 1


def row_limit(kernels: Kernels) -> int:
    """The most rows one step of this build sums alike whatever the batch (see AVX2_ROW_LIMIT)."""
    return AVX2_ROW_LIMIT if kernels.decode_simd() == 2 else MAX_ROWS


def _ptr(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    assert t.is_contiguous() and t.device.type == "cpu"
    return t.data_ptr()


class CpuDecoder:
    """Binds one bf16 Llama-family model (and, lazily, one KV pool) to the C decode step.
    It reads the model's weights in place: `layers[i]` with input_layernorm,
    qkv_weight/qkv_bias, o_weight/o_bias, post_attention_layernorm, gate_up_weight,
    down_weight; `embed_tokens`, `norm`, `lm_head` (None when tied), rope_cos/rope_sin.
    Where the model carries `gguf_blocks` (models/gguf_blocks.py, --quantization gguf),
    the matrices found there are read as GGUF blocks instead of the bf16 copies."""

    def __init__(self, model: Any, kernels: Kernels, threads: int, max_rows: int = MAX_ROWS,
                 native_blocks: bool = True) -> None:
        if threads not in (1, 2):
            raise ValueError(f"the C decode kernel runs on 1 or 2 threads, got {threads}")
        if not 1 <= max_rows <= row_limit(kernels):
            raise ValueError(f"this build of the C decode kernel takes 1..{row_limit(kernels)} rows, got {max_rows}")
        self.model, self.kernels, self.threads, self.max_rows = model, kernels, threads, max_rows
        # the model's GGUF blocks, read instead of its bf16 matrices (native_blocks=False: the bf16 path)
        self.blocks = getattr(model, "gguf_blocks", None) if native_blocks else None
        c = model.config
        # Addresses are filled in when a pool is bound, with the layer table (it holds K/V too).
        self.params = DecodeModel(n_layers=len(model.layers), vocab=c.vocab_size, hidden=c.hidden_size,
                                  nh=c.num_heads, nkv=c.num_kv_heads, d=c.head_dim, inter=c.intermediate_size,
                                  eps=float(model.norm.eps))
        self._pool: Any = None  # held, so a new pool can never reuse its id/addresses
        self._table = torch.empty(0, dtype=torch.int64)
        self._ws: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._flip = 0
        self._fws = torch.empty(0, dtype=torch.float32)
        self._max_len = 0
        self.steps = 0  # decode steps run here (tests and stats read it)
        # Run a decode-like batch of more than max_rows tokens as several steps of at most
        # max_rows (ModelRunner sets it from the calibration: off where the torch forward
        # beat this step at some larger count).
        self.split = False

    @classmethod
    def create(cls, model: Any, threads: int | None = None, max_rows: int = MAX_ROWS) -> "CpuDecoder | None":
        """A decoder for `model`, or None where the kernel does not apply (not bf16 on
        the CPU, a tensor-parallel shard, or no C compiler). Builds the library now, so the
        first request does not wait for the compiler."""
        if model.dtype != torch.bfloat16 or model.embed_tokens.device.type != "cpu":
            return None
        tp = getattr(model, "tp", None)
        if tp is not None and tp.size > 1:
            # The step is one C call over all layers: no point inside it to all_reduce at.
            log.info("C decode kernel off: the model is split over %d tensor-parallel ranks; "
                     "decode steps run the torch forward", tp.size)
            return None
        kernels = binding.kernels()
        return cls(model, kernels, threads or default_threads(), max_rows) if kernels is not None else None

    def supports(self, batch: ForwardBatch, pool: Any) -> bool:
        """Whether this step can run here: new tokens on a bf16 pool, each request
        extending a non-empty prefix (a decode step; or a few tokens per request:
        speculative drafts, a jump-forward run), at most max_rows of them, or more when
        `split` is on and no request brings more than SPLIT_EXTEND tokens (a longer extend
        is prefill-like work, where the torch forward's GEMMs cost less per token)."""
        n = batch.num_tokens
        fits = 0 < n <= self.max_rows or (n > 0 and self.split and max(batch.extend_lens_cpu) <= SPLIT_EXTEND)
        return (fits and pool is not None and pool.dtype == torch.bfloat16 and batch.input_ids.device.type == "cpu"
                and batch.req_to_token.dtype == torch.int64 and all(p > 0 for p in batch.prefix_lens_cpu))

    @property
    def quantization(self) -> str:
        """`gguf` where any matrix is read as GGUF blocks, else `none`."""
        return "gguf" if any(t != WeightType.BF16 for _, t in self._matrices()) else "none"

    def weight_types(self) -> dict[str, int]:
        """The model file's matrices per type as the step reads them (e.g. {"Q4_1": 210,
        "Q8_0": 1}; "bf16" for the rest), or {} for a model without GGUF blocks."""
        return dict(self.blocks.tensors) if self.blocks is not None else {}

    def _pick(self, block: Any, bf16: torch.Tensor) -> tuple[int, int]:
        """(address, SGL_T_* type) of one matrix: its GGUF blocks where present and whole
        blocks of a type the kernel multiplies, else the bf16 tensor."""
        if block is not None:
            rows, n_in = bf16.shape
            row_bytes = self.kernels.quant_row_bytes(block.wtype, n_in)
            if row_bytes and tuple(block.data.shape) == (rows, row_bytes):
                return _ptr(block.data), int(block.wtype)
        return _ptr(bf16), int(WeightType.BF16)

    def _matrices(self) -> list[tuple[int, int]]:
        """(address, type) per matrix: each layer's qkv, o, gate_up, down, then the
        embedding and the vocab projection."""
        m, blocks = self.model, self.blocks
        out = []
        for i, layer in enumerate(m.layers):
            b = blocks.layers[i] if blocks is not None else {}
            out += [self._pick(b.get("qkv"), layer.qkv_weight), self._pick(b.get("o"), layer.o_weight),
                    self._pick(b.get("gate_up"), layer.gate_up_weight), self._pick(b.get("down"), layer.down_weight)]
        embed = self._pick(blocks.embed if blocks is not None else None, m.embed_tokens)
        if m.lm_head is None:
            head = embed
        else:
            head = self._pick(blocks.head if blocks is not None else None, m.lm_head)
        return out + [embed, head]

    def _bind_pool(self, pool: Any, max_context: int) -> None:
        mats = self._matrices()
        rows = []
        for i, (layer, k, v) in enumerate(zip(self.model.layers, pool.k_buffers, pool.v_buffers)):
            (qkv, qkv_t), (o, o_t), (gu, gu_t), (down, down_t) = mats[4 * i: 4 * i + 4]
            rows.append([_ptr(layer.input_layernorm.weight), qkv, _ptr(layer.qkv_bias), o, _ptr(layer.o_bias),
                         _ptr(layer.post_attention_layernorm.weight), gu, down, _ptr(k), _ptr(v),
                         qkv_t, o_t, gu_t, down_t])
        self._table = torch.tensor(rows, dtype=torch.int64)
        assert self._table.shape[1] == self.kernels.decode_fields()
        m, p = self.model, self.params
        p.layers, p.norm_w = _ptr(self._table), _ptr(m.norm.weight)
        (p.embed, p.embed_t), (p.head_w, p.head_t) = mats[-2], mats[-1]
        p.rope_cos, p.rope_sin = _ptr(m.rope_cos), _ptr(m.rope_sin)
        self._max_len = max_context
        self._fws_rows = self.max_rows
        self._fws = torch.empty(self.kernels.decode_fws(self.params, max_context, self._fws_rows), dtype=torch.float32)
        self._pool = pool

    def _workspace(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for `b` rows, and the logits buffer to write this step. Logits buffers
        alternate between two instead of being copied out each step: the
        caller is done with a step's logits before the step after next overwrites them."""
        ws = self._ws.get(self.max_rows)  # one set sized for max_rows serves every b (sizes grow with rows)
        if ws is None:
            n, m = self.kernels.decode_ws(self.params, self.max_rows), self.max_rows
            ws = self._ws[m] = (torch.empty(n, dtype=torch.bfloat16),
                                [torch.empty(m, self.params.vocab, dtype=torch.float32) for _ in range(2)])
        self._flip ^= 1
        return ws[0], ws[1][self._flip][:b]

    @staticmethod
    def _token_rows(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(table row, sequence length) per new token. The kernel writes every row's K/V
        before any row attends, so a request's tokens can be separate rows sharing its table
        row, each attending up to itself (seq_len = position + 1): causal attention, and
        each row summed exactly as in a one-token step."""
        if batch.is_decode:
            return batch.req_pool_indices.contiguous(), batch.seq_lens.contiguous()
        rows = torch.repeat_interleave(batch.req_pool_indices, batch.extend_lens)
        return rows.contiguous(), (batch.positions + 1).contiguous()

    def forward(self, batch: ForwardBatch, pool: Any) -> torch.Tensor:
        if self._pool is not pool or batch.req_to_token.shape[1] > self._max_len:
            self._bind_pool(pool, batch.req_to_token.shape[1])
        logits = self._run(batch)
        want = batch.logits_indices
        n = batch.num_tokens
        if len(want) == n and bool((want == torch.arange(n)).all()):
            return logits
        return logits.index_select(0, want)

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of every new token, in order: one kernel step, or several of at most
        max_rows tokens each in order (each row's result does not depend on the rows it
        runs with, and a later step's rows attend to K/V the earlier ones wrote)."""
        b = batch.num_tokens
        ids, pos, loc = batch.input_ids.contiguous(), batch.positions.contiguous(), batch.out_cache_loc.contiguous()
        rows, lens = self._token_rows(batch)
        self.steps += 1
        if b <= self.max_rows:
            ws, logits = self._workspace(b)
            self._step(batch, ids, pos, loc, rows, lens, ws, logits)
            return logits
        ws, _ = self._workspace(self.max_rows)
        logits = torch.empty(b, self.params.vocab, dtype=torch.float32)
        for lo in range(0, b, self.max_rows):
            hi = min(b, lo + self.max_rows)
            self._step(batch, ids[lo:hi], pos[lo:hi], loc[lo:hi], rows[lo:hi], lens[lo:hi], ws, logits[lo:hi])
        return logits

    def _step(self, batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor, loc: torch.Tensor,
              rows: torch.Tensor, lens: torch.Tensor, ws: torch.Tensor, logits: torch.Tensor) -> None:
        """One kernel call over len(ids) <= max_rows token rows (contiguous views)."""
        r2t = batch.req_to_token
        step = DecodeBatch(rows=int(ids.shape[0]), input_ids=_ptr(ids), positions=_ptr(pos), out_loc=_ptr(loc),
                           req_rows=_ptr(rows), seq_lens=_ptr(lens), req_to_token=_ptr(r2t),
                           r2t_stride=r2t.stride(0), max_len=self._max_len, max_rows=self._fws_rows, ws=_ptr(ws),
                           fws=_ptr(self._fws), logits=_ptr(logits), threads=self.threads)
        rc = self.kernels.decode_step(self.params, step)
        if rc != Status.OK:
            raise RuntimeError(f"CPU decode kernel: {rc.message}")
