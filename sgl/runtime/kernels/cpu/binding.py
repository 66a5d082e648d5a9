"""The one ctypes binding of the CPU kernel library, mirroring sgl_kernels.h.

The header declares every exported function, the parameter structs they take and the
status codes they return; this module repeats each of those once (the `Structure`s and
`Status` below, the argument types in `_SIGNATURES`) and wraps the library in `Kernels`,
whose methods take plain ints (tensor addresses, sizes) or the structs. `kernels(march)`
builds or reuses the library through `load()` and binds it once per build variant. The
callers (decode.py, ops.py, attention/cpu_backend.py) fill the structs and never touch
ctypes argument types themselves. Change this file together with sgl_kernels.h.
"""

from __future__ import annotations

import ctypes
from enum import IntEnum

from sgl.runtime.kernels.cpu import load

_p, _i, _f, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64


class Status(IntEnum):
    """sgl_status: what an int-returning entry point reports."""

    OK = 0
    CONTEXT_TOO_LONG = 1
    POSITION_OUT_OF_RANGE = 2
    UNSUPPORTED = 3
    NO_MEMORY = 4

    @property
    def message(self) -> str:
        return _MESSAGES[self]


_MESSAGES = {
    Status.OK: "ok",
    Status.CONTEXT_TOO_LONG: "a context is longer than the request table",
    Status.POSITION_OUT_OF_RANGE: "a RoPE position is outside the cos/sin tables",
    Status.UNSUPPORTED: "this build, shape or weight type is not supported (attention needs AVX512-BF16, "
                        "head_dim 64 or 128; the decode step takes rows of at least one key, at most as many "
                        "as its scratch was sized for; block weights need whole blocks of Q8_0/Q4_0/Q4_1/Q4_K/Q6_K)",
    Status.NO_MEMORY: "out of memory",
}


class WeightType(IntEnum):
    """SGL_T_*: a weight matrix's type tag (GGML's type ids; gguf.GGMLQuantizationType)."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14
    BF16 = 30


class DecodeModel(ctypes.Structure):
    """sgl_decode_model: a Llama-family model (bf16 or GGUF-block matrices), fixed for the
    life of a decoder."""

    _fields_ = [("n_layers", _i), ("layers", _p), ("embed", _p), ("norm_w", _p), ("head_w", _p),
                ("vocab", _i), ("hidden", _i), ("nh", _i), ("nkv", _i), ("d", _i), ("inter", _i),
                ("eps", _f), ("rope_cos", _p), ("rope_sin", _p), ("embed_t", _i), ("head_t", _i)]


class DecodeBatch(ctypes.Structure):
    """sgl_decode_batch: one step of single-token rows and its scratch."""

    _fields_ = [("rows", _i), ("input_ids", _p), ("positions", _p), ("out_loc", _p), ("req_rows", _p),
                ("seq_lens", _p), ("req_to_token", _p), ("r2t_stride", _i64), ("max_len", _i), ("max_rows", _i),
                ("ws", _p), ("fws", _p), ("logits", _p), ("threads", _i)]


class AttnParams(ctypes.Structure):
    """sgl_attn_params: one layer's attention of a step over the KV pool."""

    _fields_ = [("q", _p), ("q_stride", _i64), ("out", _p), ("k_pool", _p), ("v_pool", _p), ("rows", _p),
                ("row_stride", _i64), ("nreq", _i), ("q_start", _p), ("prefix", _p), ("extend", _p),
                ("shared", _i), ("nh", _i), ("nkv", _i), ("d", _i), ("scale", _f), ("ws", _p), ("threads", _i)]


class RopeParams(ctypes.Structure):
    """sgl_rope_params: RoPE in place on the q and k heads of qkv rows."""

    _fields_ = [("qkv", _p), ("stride", _i64), ("rows", _i), ("nh", _i), ("d", _i), ("cos_t", _p),
                ("sin_t", _p), ("positions", _p), ("max_pos", _i64), ("threads", _i)]


class KVCopy(ctypes.Structure):
    """sgl_kv_copy: token rows between the KV pool and the host tier's pages."""

    _fields_ = [("to_host", _i), ("host", _p), ("k_pool", _p), ("v_pool", _p), ("n_layers", _i),
                ("page_size", _i), ("row_bytes", _i64), ("n", _i64), ("pages", _p), ("pos", _p), ("slots", _p), ("threads", _i)]


_SIGNATURES: dict[str, tuple[type | None, list]] = {
    "sgl_decode_fields": (_i, []),
    "sgl_decode_simd": (_i, []),
    "sgl_decode_ws": (_i64, [ctypes.POINTER(DecodeModel), _i]),
    "sgl_decode_fws": (_i64, [ctypes.POINTER(DecodeModel), _i, _i]),
    "sgl_decode_step": (_i, [ctypes.POINTER(DecodeModel), ctypes.POINTER(DecodeBatch)]),
    "sgl_quant_simd": (_i, []),
    "sgl_quant_row_bytes": (_i64, [_i, _i]),
    "sgl_quant_gemv": (_i, [_i, _p, _i, _i, _p, _i, _p]),
    "sgl_quant_dequant": (_i, [_i, _p, _i, _i, _p]),
    "sgl_qgemm_simd": (_i, []),
    "sgl_qgemm_packed_bytes": (_i64, [_i, _i, _i]),
    "sgl_qgemm_pack": (_i, [_i, _p, _i, _i, _p]),
    "sgl_qgemm": (_i, [_p, _i, _i, _i, _p, _i, _p, _p, _i]),
    "sgl_attn_simd": (_i, []),
    "sgl_attn_ws_bytes": (_i64, [ctypes.POINTER(AttnParams)]),
    "sgl_attn_forward": (_i, [ctypes.POINTER(AttnParams)]),
    "sgl_ops_simd": (_i, []),
    "sgl_ops_rmsnorm": (None, [_p, _p, _p, _i, _i, _f, _i]),
    "sgl_ops_add_rmsnorm": (None, [_p, _p, _p, _p, _i, _i, _f, _i]),
    "sgl_ops_rope": (_i, [ctypes.POINTER(RopeParams)]),
    "sgl_ops_silu_mul": (None, [_p, _p, _i, _i, _i]),
    "sgl_kv_copy_run": (None, [ctypes.POINTER(KVCopy)]),
}


class Kernels:
    """The library with every function declared; pointers are ints (0 or None: NULL)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self.lib = lib  # calls look functions up here each time (profile_engine.py wraps them)

    # ---- decode step
    def decode_simd(self) -> int:
        """The decode step's vector code in this build: 0 plain C, 1 AVX512-BF16, 2 AVX2+FMA."""
        return int(self.lib.sgl_decode_simd())

    def decode_fields(self) -> int:
        return int(self.lib.sgl_decode_fields())

    def decode_ws(self, model: DecodeModel, rows: int) -> int:
        return int(self.lib.sgl_decode_ws(ctypes.byref(model), rows))

    def decode_fws(self, model: DecodeModel, max_len: int, max_rows: int) -> int:
        return int(self.lib.sgl_decode_fws(ctypes.byref(model), max_len, max_rows))

    def decode_step(self, model: DecodeModel, batch: DecodeBatch) -> Status:
        return Status(self.lib.sgl_decode_step(ctypes.byref(model), ctypes.byref(batch)))

    # ---- products over GGUF blocks
    def quant_simd(self) -> int:
        """The block products' vector code: 0 plain C, 2 AVX2, 3 AVX2 with VNNI dot products."""
        return int(self.lib.sgl_quant_simd())

    def quant_row_bytes(self, wtype: int, n_in: int) -> int:
        """Bytes of one row of `n_in` inputs; 0 where `wtype` has no product here or `n_in`
        is not whole blocks."""
        return int(self.lib.sgl_quant_row_bytes(wtype, n_in))

    def quant_gemv(self, wtype: int, w: int, out: int, n_in: int, x: int, rows: int, y: int) -> Status:
        return Status(self.lib.sgl_quant_gemv(wtype, w, out, n_in, x, rows, y))

    def quant_dequant(self, wtype: int, w: int, rows: int, n_in: int, out: int) -> Status:
        return Status(self.lib.sgl_quant_dequant(wtype, w, rows, n_in, out))

    # ---- many-row products over GGUF blocks in tile form
    def qgemm_simd(self) -> int:
        """The tiled block product's vector code: 0 plain C, 1 AVX512-VNNI."""
        return int(self.lib.sgl_qgemm_simd())

    def qgemm_packed_bytes(self, wtype: int, out: int, n_in: int) -> int:
        return int(self.lib.sgl_qgemm_packed_bytes(wtype, out, n_in))

    def qgemm_pack(self, wtype: int, w: int, out: int, n_in: int, packed: int) -> Status:
        return Status(self.lib.sgl_qgemm_pack(wtype, w, out, n_in, packed))

    def qgemm(self, packed: int, wtype: int, out: int, n_in: int, x: int, rows: int, bias: int | None, y: int,
              threads: int) -> Status:
        return Status(self.lib.sgl_qgemm(packed, wtype, out, n_in, x, rows, bias, y, threads))

    # ---- attention
    def attn_simd(self) -> bool:
        return bool(self.lib.sgl_attn_simd())

    def attn_ws_bytes(self, p: AttnParams) -> int:
        return int(self.lib.sgl_attn_ws_bytes(ctypes.byref(p)))

    def attn_forward(self, p: AttnParams) -> Status:
        return Status(self.lib.sgl_attn_forward(ctypes.byref(p)))

    # ---- fused row ops
    def ops_simd(self) -> bool:
        return bool(self.lib.sgl_ops_simd())

    def rmsnorm(self, x: int, w: int, out: int, rows: int, n: int, eps: float, threads: int) -> None:
        self.lib.sgl_ops_rmsnorm(x, w, out, rows, n, eps, threads)

    def add_rmsnorm(self, x: int, y: int, w: int, out: int | None, rows: int, n: int, eps: float,
                    threads: int) -> None:
        self.lib.sgl_ops_add_rmsnorm(x, y, w, out, rows, n, eps, threads)

    def rope(self, p: RopeParams) -> Status:
        return Status(self.lib.sgl_ops_rope(ctypes.byref(p)))

    def silu_mul(self, gu: int, out: int, rows: int, n: int, threads: int) -> None:
        self.lib.sgl_ops_silu_mul(gu, out, rows, n, threads)

    # ---- KV tier copies
    def kv_copy(self, c: KVCopy) -> None:
        self.lib.sgl_kv_copy_run(ctypes.byref(c))


_bound: dict[str, Kernels | None] = {}


def kernels(march: str = "native") -> Kernels | None:
    """The bound library for `march` (see load()), or None where it cannot be built."""
    if march not in _bound:
        lib = load(march)
        _bound[march] = Kernels(lib) if lib is not None else None
    return _bound[march]
