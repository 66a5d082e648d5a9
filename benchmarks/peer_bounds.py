"""Physical bounds of this host for bench_peers' workloads: what no system could beat.

A decode step must read every weight once and the KV of every context token once, so its
time is at least (weight bytes + KV bytes) / measured memory bandwidth; it must also do
2 FLOPs per weight per row, so at least FLOPs / measured matmul rate. A prefill is bound
by its FLOPs (the matmuls plus causal attention) over the best measured matmul rate of the
dtypes a system could choose here (bf16 where the CPU has bf16 units, fp32 where it has
not: on AVX2-only hosts fp32 GEMMs are several times faster; our int8 products over GGUF
blocks where the build has AVX512-VNNI). Every bound is a rate in
tokens/s, so a row can print its own number next to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from common import measure_bandwidth_gbs, measure_bf16_tflops, measure_fp32_tflops, measure_int8_tflops


@dataclass(frozen=True)
class Host:
    bandwidth_gbs: float  # large-copy read+write bandwidth
    bf16_tflops: float
    fp32_tflops: float
    int8_tflops: float = 0.0  # tiled int8 products over GGUF blocks (0: not offered here)

    @property
    def matmul_tflops(self) -> float:
        return max(self.bf16_tflops, self.fp32_tflops, self.int8_tflops)


def measure_host() -> Host:
    return Host(measure_bandwidth_gbs(), measure_bf16_tflops(), measure_fp32_tflops(), measure_int8_tflops())


@dataclass(frozen=True)
class ModelShape:
    params: int  # all parameters (embedding included)
    embed_params: int  # vocab x hidden (a lookup in prefill, the lm_head's matmul in decode)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


def decode_bound_tok_s(host: Host, m: ModelShape, weight_bytes: int, rows: int, context: float) -> float:
    """Aggregate tokens/s of `rows` streams, each with `context` tokens of KV on average."""
    bytes_per_step = weight_bytes + rows * context * m.kv_bytes_per_token()
    t_mem = bytes_per_step / (host.bandwidth_gbs * 1e9)
    flops = rows * (2 * m.params + 4 * m.layers * m.heads * m.head_dim * context)
    t_flop = flops / (host.matmul_tflops * 1e12)
    return rows / max(t_mem, t_flop)


def prefill_flops(m: ModelShape, tokens: int) -> float:
    """Every non-embedding weight in a matmul per token (the lm_head only for the last
    token) plus causal attention (QK^T and PV over ~t/2 keys on average)."""
    linear = 2 * (m.params - m.embed_params) * tokens + 2 * m.embed_params
    attention = 2 * 2 * m.layers * m.heads * m.head_dim * tokens * tokens / 2
    return linear + attention


def prefill_bound_tok_s(host: Host, m: ModelShape, tokens: int) -> float:
    return tokens / (prefill_flops(m, tokens) / (host.matmul_tflops * 1e12))
