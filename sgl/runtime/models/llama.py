"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2) running on a ragged ForwardBatch.

Our own forward, written for the CPU first: q/k/v are one fused matmul and gate/up
another, weights and activations stay in one dtype (bf16 on CPU, where AVX512-BF16 or AMX makes it
several times faster than fp32), RoPE uses a precomputed cos/sin table indexed by
`batch.positions`, and attention (with the KV pool) is delegated to the backend. Only
the rows in `batch.logits_indices` go through the final norm and the vocab projection.
Weights are loaded from Hugging Face tensor names with `load_weights`. Small bf16
decode batches on the CPU run as one C call instead of this forward (the model runner
chooses, kernels/cpu/decode.py). Other bf16 CPU steps run the elementwise ops between
the matmuls as fused C passes (kernels/cpu/ops.py: residual add + RMSNorm, RoPE in
place, SiLU*up); fp32 and other devices keep the plain torch ops.

Under tensor parallelism (`tp`, distributed/parallel.py) each rank allocates and loads
only its shard: its heads of QKV and O, its intermediate rows of gate_up and down, its
vocab rows of the embedding and the LM head. The two row-parallel products (O, down)
end in an all_reduce, the embedding lookup too, and the logits are gathered on rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sgl.runtime.attention.base import AttentionBackend
from sgl.runtime.distributed import parallel
from sgl.runtime.distributed.parallel import HeadShard, TPInfo, all_reduce, head_shard, shard_range
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.models.config import ModelConfig
from sgl.runtime.kernels.cpu import ops as cpu_ops
from sgl.runtime.kernels.cpu.linear import (Fp32Weight, PackedWeight, TileWeight, fp32_weight, linear, pack_weight,
                                            tile_weight)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies (float32), with HF's 'linear' / 'llama3' scaling."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    kind = (rs or {}).get("rope_type", (rs or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(rs["factor"])  # type: ignore[index]
    if kind == "llama3":
        assert rs is not None
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_ctx = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) & ~(wavelen > old_ctx / lo)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


class Piece(NamedTuple):
    """Where one checkpoint tensor's local slice goes: into `attr` at row `dst_row` (None:
    the whole parameter), read as rows (`dim` 0) or columns (1) [lo, hi), or whole (None)."""

    attr: str
    dst_row: int | None = None
    dim: int | None = None
    lo: int = 0
    hi: int = 0

    def read(self, w: Any) -> torch.Tensor:
        if self.dim is None:
            return w[:]
        return w[self.lo : self.hi] if self.dim == 0 else w[:, self.lo : self.hi]


@dataclass(frozen=True)
class LlamaShard:
    """What one tensor-parallel rank holds, as ranges of the whole model (the rules are
    distributed/parallel.py's): its heads, intermediate rows [lo, hi), vocab rows [lo, hi)."""

    heads: HeadShard
    inter: tuple[int, int]
    vocab: tuple[int, int]

    @staticmethod
    def of(c: ModelConfig, tp: TPInfo) -> "LlamaShard":
        return LlamaShard(head_shard(c.num_heads, c.num_kv_heads, tp),
                          shard_range(c.intermediate_size, tp, "intermediate rows"),
                          shard_range(c.vocab_size, tp, "vocab rows"))

    @property
    def inter_rows(self) -> int:
        return self.inter[1] - self.inter[0]

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 (as HF does) then scale in the model dtype. F.rms_norm is the
        # same arithmetic (bit-identical) in one call instead of five small ops.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class DecoderLayer(nn.Module):
    """One layer, or one rank's shard of it: `h`/`kv` local heads, `shard.inter_rows`
    intermediate rows; the norms and `o_bias` are whole on every rank."""

    def __init__(self, c: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPInfo, shard: LlamaShard) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.h, self.kv, self.d = shard.heads.num_heads, shard.heads.num_kv_heads, c.head_dim
        qkv_rows = (self.h + 2 * self.kv) * self.d
        inter = shard.inter_rows
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.qkv_weight = _param(qkv_rows, c.hidden_size, dtype=dtype)
        self.qkv_bias = _param(qkv_rows, dtype=dtype) if c.attention_bias else None
        self.o_weight = _param(c.hidden_size, self.h * self.d, dtype=dtype)
        self.o_bias = _param(c.hidden_size, dtype=dtype) if c.o_proj_bias else None
        self.gate_up_weight = _param(2 * inter, c.hidden_size, dtype=dtype)
        self.down_weight = _param(c.hidden_size, inter, dtype=dtype)
        # Each projection's fast form, if any: prepacked bf16, or fp32 (kernels/cpu/linear.py).
        self.packed: dict[str, PackedWeight | Fp32Weight | TileWeight | None] = {}

    @property
    def o_bias_here(self) -> torch.Tensor | None:
        """The O bias this rank adds: rank 0 alone, before the all_reduce, so the sum holds it once."""
        return self.o_bias if self.tp.rank == 0 else None

    def prepack(self, verified: dict[tuple, int]) -> None:
        """Pack the projection weights for fast small-batch matmuls (see kernels/cpu/linear.py)."""
        biases = {"qkv_weight": self.qkv_bias, "o_weight": self.o_bias_here}
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            self.packed[name] = pack_weight(getattr(self, name), biases.get(name), verified)

    def use_fp32_linears(self, verified: dict[tuple, int]) -> int:
        """Run the projections as fp32 GEMMs on fp32 copies where verified; how many switched."""
        biases = {"qkv_weight": self.qkv_bias, "o_weight": self.o_bias_here}
        n = 0
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            fw = fp32_weight(getattr(self, name), biases.get(name), verified)
            if fw is not None:
                self.packed[name], n = fw, n + 1
        return n

    def tile_forms(self, blocks: dict[str, Any], threads: int) -> dict[str, TileWeight]:
        """The projections that have GGUF blocks of a tiled type (`blocks`: this layer's entry
        of model.gguf_blocks) in qgemm.c's tile form, by weight name."""
        biases = {"qkv_weight": self.qkv_bias, "o_weight": self.o_bias_here}
        out = {}
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            b = blocks.get(name.removesuffix("_weight"))
            tw = tile_weight(b.data, b.wtype, tuple(getattr(self, name).shape), biases.get(name), threads) if b else None
            if tw is not None:
                out[name] = tw
        return out

    def use_tile_linears(self, blocks: dict[str, Any], threads: int) -> int:
        """Run the projections that have a tile form on int8 dot products; how many switched."""
        forms = self.tile_forms(blocks, threads)
        self.packed.update(forms)
        return len(forms)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """cos/sin: [T, 1, 2, d/2] as built by `LlamaForCausalLM.forward` (see there)."""
        t = x.shape[0]
        h, kv, d = self.h, self.kv, self.d
        pk = self.packed
        qkv = linear(self.input_layernorm(x), self.qkv_weight, pk.get("qkv_weight"), self.qkv_bias)
        # q and k heads are contiguous in the fused output: rotate them in one go. With the
        # halves as a size-2 axis, rotate_half is a flip of that axis (sign folded into sin).
        qk = qkv[:, : (h + kv) * d].view(t, h + kv, 2, d // 2)
        qk = (qk * cos + qk.flip(2) * sin).view(t, h + kv, d)
        v = qkv[:, (h + kv) * d :].view(t, kv, d)
        o = attn.forward(qk[:, :h], qk[:, h:], v, self.layer_id, batch)
        o = linear(o.reshape(t, h * d), self.o_weight, pk.get("o_weight"), self.o_bias_here)
        x = x + all_reduce(o, self.tp)
        gate, up = linear(self.post_attention_layernorm(x), self.gate_up_weight, pk.get("gate_up_weight")).chunk(2, dim=-1)
        return x + all_reduce(linear(F.silu(gate) * up, self.down_weight, pk.get("down_weight")), self.tp)

    def forward_fused(self, x: torch.Tensor, xn: torch.Tensor, rope: tuple, batch: ForwardBatch,
                      attn: AttentionBackend, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the fused CPU ops: `xn` is this layer's input norm of `x` (the caller
        fused it with the previous residual add). Returns (residual, MLP output), which the
        caller adds (fused with the next norm); the residual is `x`, updated in place, or,
        with `keep`, only those rows: past attention, no other row reaches the logits."""
        t = x.shape[0]
        h, kv, d = self.h, self.kv, self.d
        pk = self.packed
        qkv = linear(xn, self.qkv_weight, pk.get("qkv_weight"), self.qkv_bias)
        cpu_ops.rope_(qkv, *rope, h + kv, d)
        q, k, v = qkv.split([h * d, kv * d, kv * d], dim=1)
        o = attn.forward(q.view(t, h, d), k.view(t, kv, d), v.view(t, kv, d), self.layer_id, batch).reshape(t, h * d)
        if keep is not None:  # always gathered: the logits rows may come in any order
            o, x = o[keep], x[keep]
        o = all_reduce(linear(o, self.o_weight, pk.get("o_weight"), self.o_bias_here), self.tp)
        ln2 = self.post_attention_layernorm
        xn = cpu_ops.add_rmsnorm(x, o, ln2.weight, ln2.eps)
        act = cpu_ops.silu_mul(linear(xn, self.gate_up_weight, pk.get("gate_up_weight")))
        return x, all_reduce(linear(act, self.down_weight, pk.get("down_weight")), self.tp)


class LlamaForCausalLM(nn.Module):
    """The model, or with `tp` one rank's shard of it. A rank's KV pool holds
    `num_local_kv_heads` heads; its attention runs `num_local_heads` query heads."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, tp: TPInfo = TPInfo()) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.shard = LlamaShard.of(config, tp)
        self.num_local_heads = self.shard.heads.num_heads
        self.num_local_kv_heads = self.shard.heads.num_kv_heads
        vocab_rows = self.shard.vocab_rows
        self.embed_tokens = _param(vocab_rows, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, tp, self.shard) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else _param(vocab_rows, config.hidden_size, dtype=dtype)
        freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), rope_inv_freq(config))
        # Cached in the model dtype: HF also casts cos/sin to the activation dtype.
        self.register_buffer("rope_cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", freqs.sin().to(dtype), persistent=False)
        self.packed_head: PackedWeight | Fp32Weight | TileWeight | None = None

    def prepack(self) -> None:
        """Pack weights for fast small batches on the CPU; call after the weights are loaded."""
        verified: dict[tuple, int] = {}  # one check per weight shape (see kernels/cpu/linear.py)
        for layer in self.layers:
            layer.prepack(verified)
        self.packed_head = pack_weight(self.embed_tokens if self.lm_head is None else self.lm_head, None, verified)

    def use_fp32_linears(self, verified: dict[tuple, int] | None = None) -> tuple[int, int]:
        """Switch the bf16 CPU projections (and the LM head) to the fp32 GEMM path, weight
        shapes where it checks out bit-stable (kernels/cpu/linear.py); (switched, total).
        `verified`: the per-shape checks, filled in here (a caller may keep them per host)."""
        verified = {} if verified is None else verified
        n = sum(layer.use_fp32_linears(verified) for layer in self.layers)
        head = fp32_weight(self.embed_tokens if self.lm_head is None else self.lm_head, None, verified)
        if head is not None:
            self.packed_head, n = head, n + 1
        return n, 4 * len(self.layers) + 1

    def use_tile_linears(self, threads: int) -> tuple[int, int]:
        """Switch the layers' projections and the LM head to int8 products over the GGUF
        blocks (where the model carries `gguf_blocks` and the type has a tile form);
        (switched, total). The head's blocks are the embedding's when the two are tied: a
        batch past the C decode step's rows (a wide decode of forks) then computes its logits
        from the same int8 products as the step does, at half the bytes of the bf16 head."""
        blocks = getattr(self, "gguf_blocks", None)
        total = 4 * len(self.layers) + 1
        if blocks is None:
            return 0, total
        n = sum(layer.use_tile_linears(b, threads) for layer, b in zip(self.layers, blocks.layers))
        head, hb = (self.embed_tokens, blocks.embed) if self.lm_head is None else (self.lm_head, blocks.head)
        tw = tile_weight(hb.data, hb.wtype, tuple(head.shape), None, threads) if hb is not None else None
        if tw is not None:
            self.packed_head, n = tw, n + 1
        return n, total

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor | None:
        """Float32 logits `[len(batch.logits_indices), vocab]`; under tensor parallelism on
        rank 0 only (the other ranks return None). Every rank must run every step."""
        attn.init_forward(batch)
        x = parallel.embedding(batch.input_ids, self.embed_tokens, self.shard.vocab[0], self.tp)
        if cpu_ops.applies(x):
            return self._forward_fused(x, batch, attn)
        # [T, 1, 2, d/2], broadcast over heads: (cos, cos) and (-sin, sin) for the two halves,
        # so each layer's rotation is x * cos + flip(x) * sin, exactly HF's arithmetic.
        c = self.rope_cos[batch.positions].unsqueeze(1)
        s = self.rope_sin[batch.positions].unsqueeze(1)
        cos, sin = torch.stack((c, c), dim=2), torch.stack((-s, s), dim=2)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        for layer in self.layers:
            x = layer(x, cos, sin, batch, attn)
        x = self.norm(x[batch.logits_indices])
        return parallel.gather_logits(linear(x, head, self.packed_head), self.config.vocab_size, self.tp)

    def _forward_fused(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor | None:
        """`forward` on bf16 CPU tensors with the fused ops (same rounding, see kernels/cpu/ops.py)."""
        rope = (batch.positions, self.rope_cos, self.rope_sin)
        ln = self.layers[0].input_layernorm
        xn = cpu_ops.rmsnorm(x, ln.weight, ln.eps)
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            # The last layer finishes only the rows that produce logits (e.g. 1 of a prefill's).
            x, y = layer.forward_fused(x, xn, rope, batch, attn, batch.logits_indices if i + 1 == n else None)
            ln = self.layers[i + 1].input_layernorm if i + 1 < n else self.norm
            xn = cpu_ops.add_rmsnorm(x, y, ln.weight, ln.eps)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return parallel.gather_logits(linear(xn, head, self.packed_head), self.config.vocab_size, self.tp)

    def load_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up and keeping only this
        rank's slice of each; raise on gaps and wrong shapes. A value is a tensor or a lazy
        safetensors slice (`get_shape()`, `[lo:hi]`, `[:, lo:hi]`): only the slice is read."""
        c = self.config
        items = weights.items() if isinstance(weights, Mapping) else weights
        expected = dict(hf_weight_shapes(c))
        pieces = self._layer_pieces()
        seen: set[str] = set()
        for name, w in items:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            dst, piece = self._locate(name, pieces)
            if dst is None or name not in expected:
                raise ValueError(f"unexpected weight {name!r} for {c.architecture}")
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else tuple(w.get_shape())
            if shape != expected[name]:
                raise ValueError(f"weight {name!r} has shape {shape}, expected {expected[name]}")
            part = piece.read(w)
            target = dst if piece.dst_row is None else dst[piece.dst_row : piece.dst_row + part.shape[0]]
            with torch.no_grad():
                target.copy_(part)
            seen.add(name)
        missing = set(expected) - seen
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:3]}")

    def _layer_pieces(self) -> dict[str, Piece]:
        """HF sub-name of a layer weight -> where this rank's slice of it goes."""
        heads, d = self.shard.heads, self.config.head_dim
        q_rows, kv_rows = (heads.q_lo * d, heads.q_hi * d), (heads.kv_lo * d, heads.kv_hi * d)
        qd, kd, inter = heads.num_heads * d, heads.num_kv_heads * d, self.shard.inter_rows
        out = {}
        for kind in ("weight", "bias"):  # column-parallel: rows of the fused outputs
            out[f"self_attn.q_proj.{kind}"] = Piece(f"qkv_{kind}", 0, 0, *q_rows)
            out[f"self_attn.k_proj.{kind}"] = Piece(f"qkv_{kind}", qd, 0, *kv_rows)
            out[f"self_attn.v_proj.{kind}"] = Piece(f"qkv_{kind}", qd + kd, 0, *kv_rows)
        out["mlp.gate_proj.weight"] = Piece("gate_up_weight", 0, 0, *self.shard.inter)
        out["mlp.up_proj.weight"] = Piece("gate_up_weight", inter, 0, *self.shard.inter)
        # Row-parallel: columns, the inputs that this rank's heads / rows produce.
        out["self_attn.o_proj.weight"] = Piece("o_weight", None, 1, *q_rows)
        out["mlp.down_proj.weight"] = Piece("down_weight", None, 1, *self.shard.inter)
        out["self_attn.o_proj.bias"] = Piece("o_bias")  # whole: rank 0 adds it (o_bias_here)
        out["input_layernorm.weight"] = Piece("input_layernorm.weight")
        out["post_attention_layernorm.weight"] = Piece("post_attention_layernorm.weight")
        return out

    def _locate(self, name: str, pieces: dict[str, Piece]) -> tuple[torch.Tensor | None, Piece]:
        vocab = Piece("", None, 0, *self.shard.vocab)
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, vocab
        if name == "model.norm.weight":
            return self.norm.weight, Piece("")
        if name == "lm_head.weight":
            return self.lm_head, vocab
        if name.startswith("model.layers."):
            idx, sub = name[len("model.layers.") :].split(".", 1)
            if sub in pieces and int(idx) < len(self.layers):
                layer, piece = self.layers[int(idx)], pieces[sub]
                obj = layer.get_parameter(piece.attr) if "." in piece.attr else getattr(layer, piece.attr)
                if obj is not None:
                    return obj, piece
        return None, Piece("")


def hf_weight_shapes(c: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes a model of this config needs (for checks and random init)."""
    out: list[tuple[str, tuple[int, ...]]] = []
    hd, qd, kd = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out.append(("model.embed_tokens.weight", (c.vocab_size, hd)))
    out.append(("model.norm.weight", (hd,)))
    if not c.tie_word_embeddings:
        out.append(("lm_head.weight", (c.vocab_size, hd)))
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (hd,)))
        out.append((p + "post_attention_layernorm.weight", (hd,)))
        out.append((p + "self_attn.q_proj.weight", (qd, hd)))
        out.append((p + "self_attn.k_proj.weight", (kd, hd)))
        out.append((p + "self_attn.v_proj.weight", (kd, hd)))
        out.append((p + "self_attn.o_proj.weight", (hd, qd)))
        if c.attention_bias:
            out.append((p + "self_attn.q_proj.bias", (qd,)))
            out.append((p + "self_attn.k_proj.bias", (kd,)))
            out.append((p + "self_attn.v_proj.bias", (kd,)))
        if c.o_proj_bias:
            out.append((p + "self_attn.o_proj.bias", (hd,)))
        out.append((p + "mlp.gate_proj.weight", (c.intermediate_size, hd)))
        out.append((p + "mlp.up_proj.weight", (c.intermediate_size, hd)))
        out.append((p + "mlp.down_proj.weight", (hd, c.intermediate_size)))
    return out


def tiny_config(**overrides: object) -> ModelConfig:
    """A 2-layer, hidden-64 GQA config (4 q / 2 kv heads, vocab 256) for fast tests."""
    base: dict = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    )
    base.update(overrides)
    return ModelConfig(**base)


def random_hf_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under HF names (norm weights near 1, others ~N(0, 0.1))."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in hf_weight_shapes(config):
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = 0.1 * torch.randn(shape, generator=g)
    return out


def tiny_random_model(config: ModelConfig | None = None, dtype: torch.dtype = torch.float32, seed: int = 0,
                      tp: TPInfo = TPInfo()) -> LlamaForCausalLM:
    """A random-weight model (`random_hf_weights`), or rank `tp.rank`'s shard of the same one."""
    config = config or tiny_config()
    model = LlamaForCausalLM(config, dtype, tp)
    model.load_weights(random_hf_weights(config, seed))
    return model.eval()
