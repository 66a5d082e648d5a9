"""Compile every kernel ahead of time for a CUDA target, with no GPU present.

Triton's real compiler (TTIR -> PTX -> cubin, with the bundled ptxas) runs on any
machine, so this catches GPU-only compile errors (dot shapes and dtypes, layouts,
constexpr misuse) that the CPU interpreter lets through. Run it in a process where
TRITON_INTERPRET is unset: `python -m sgl.runtime.kernels.aot_check [sm]` (default 90).
"""

from __future__ import annotations

import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sgl.runtime.kernels import decode_attention, extend_attention, rmsnorm_rope, store_kv


def _compile(kernel: Any, types: dict[str, str], consts: dict[str, Any], target: GPUTarget) -> None:
    names = kernel.arg_names
    # Every argument not typed below is an int32 scalar (strides, sizes).
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=target)


def _cases(dt: str) -> list[tuple[Any, dict[str, str], dict[str, Any]]]:
    p, i64 = f"*{dt}", "*i64"
    extend = (
        extend_attention._extend_attention_kernel,
        dict(q_ptr=p, k_ptr=p, v_ptr=p, o_ptr=p, k_buf_ptr=p, v_buf_ptr=p, req_to_token_ptr="*i32",
             req_pool_indices_ptr=i64, prefix_lens_ptr=i64, extend_lens_ptr=i64, extend_start_ptr=i64,
             sm_scale_log2="fp32"),
        dict(GROUP=3, HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, UPCAST=False),
    )
    stage1 = (
        decode_attention._decode_stage1_kernel,
        dict(q_ptr=p, k_buf_ptr=p, v_buf_ptr=p, req_to_token_ptr="*i32", req_pool_indices_ptr=i64,
             seq_lens_ptr=i64, part_o_ptr="*fp32", part_lse_ptr="*fp32", sm_scale_log2="fp32"),
        dict(GROUP=3, HEAD_DIM=64, NUM_SPLITS=8, BLOCK_H=16, BLOCK_N=64, BLOCK_D=64, UPCAST=False),
    )
    if dt != "bf16":
        return [extend, stage1]
    return [
        extend, stage1,
        (decode_attention._decode_stage2_kernel, dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", o_ptr=p),
         dict(HEAD_DIM=64, NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=64)),
        (store_kv._store_kv_kernel, dict(k_ptr=p, v_ptr=p, loc_ptr=i64, k_buf_ptr=p, v_buf_ptr=p),
         dict(NUM_HEADS=3, HEAD_DIM=64, BLOCK_H=4, BLOCK_D=64)),
        (rmsnorm_rope._rmsnorm_kernel, dict(x_ptr=p, res_ptr=p, w_ptr=p, out_ptr=p, eps="fp32"),
         dict(N=576, BLOCK=1024, HAS_RESIDUAL=True)),
        (rmsnorm_rope._rope_kernel, dict(x_ptr=p, pos_ptr=i64, cos_ptr=p, sin_ptr=p),
         dict(NUM_HEADS=12, HALF=32, BLOCK_H=16, BLOCK_D=32)),
    ]


def compile_all(sm: int = 90) -> list[str]:
    """Compile each kernel (bf16; attention also fp32) for sm_<sm>; returns the names done."""
    target = GPUTarget("cuda", sm, 32)
    done = []
    for dt in ("bf16", "fp32"):
        for kernel, types, consts in _cases(dt):
            _compile(kernel, types, consts, target)
            done.append(f"{kernel.__name__}[{dt}]")
    return done


if __name__ == "__main__":
    for name in compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90):
        print("compiled", name)
