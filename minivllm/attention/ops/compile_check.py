"""Compile the Triton kernels for a GPU architecture without a GPU: ``python -m minivllm.attention.ops.compile_check``.

The interpreter (``TRITON_INTERPRET=1``) checks what the kernels compute, not that Triton can lower them: a
type mismatch in a loop-carried value or an unsupported ``tl.dot`` shape only shows when compiling. Triton
compiles to a cubin on a machine without a GPU (its wheel bundles ``ptxas``), so the CPU test suite can check
that every kernel variant the launchers use builds for Hopper (sm_90, the H200), before a GPU is ever used.

Run it in a process where ``TRITON_INTERPRET`` is unset (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Dict, List

DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _signature(kernel, types: Dict[str, str], constexprs: Dict) -> Dict[str, str]:
    """Triton's ``ASTSource`` signature: every argument's type, ``"constexpr"`` for the compile-time ones,
    ``"i32"`` for the integer arguments not listed in ``types``."""
    return {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}


def compile_kernels(arch: int = 90, dtypes: List[str] = ("bfloat16", "float32")) -> List[str]:
    """Compile ``kernel_unified_attention`` (one segment and split), ``reduce_segments`` and
    ``reshape_and_cache_kernel_flash`` for CUDA compute capability ``arch`` in each of ``dtypes``, with
    SmolLM2's heads (9 query / 3 KV, head_dim 64). Returns one line per compiled variant.

    Raises:
        RuntimeError: if the kernels were imported interpreted; Triton's compile errors as they come.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minivllm.attention.ops import triton_reshape_and_cache_flash as rc
    from minivllm.attention.ops import triton_unified_attention as ua
    from minivllm.attention.ops.triton_utils import is_interpreted

    if is_interpreted(ua.kernel_unified_attention):
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1: compile in a process without it")
    target = GPUTarget("cuda", arch, 32)
    done = []

    def build(kernel, types, constexprs, label):
        t = time.perf_counter()
        compiled = triton.compile(ASTSource(kernel, _signature(kernel, types, constexprs), constexprs), target=target)
        done.append(f"{label}: {len(compiled.asm['cubin'])} bytes of sm_{arch} cubin, {time.perf_counter() - t:.1f} s")

    for dtype in dtypes:
        dt = DTYPES[dtype]
        for segments, block_size in ((1, 16), (16, 32)):
            group = 3
            constexprs = dict(NUM_QUERY_HEADS=9, NUM_QUERIES_PER_KV=group, BLOCK_SIZE=block_size, HEAD_DIM=64,
                              BLOCK_M=16, BLOCK_Q=16 // group, TILE_SIZE=ua.TILE_SIZE, NUM_SEGMENTS=segments,
                              IEEE_FP32_DOT=dtype == "float32")
            part = "*fp32" if segments > 1 else f"*{dt}"
            types = dict(output_ptr=f"*{dt}", segm_output_ptr=part, segm_max_ptr=part, segm_expsum_ptr=part,
                         query_ptr=f"*{dt}", key_cache_ptr=f"*{dt}", value_cache_ptr=f"*{dt}",
                         block_table_ptr="*i64", seq_lens_ptr="*i64", query_start_loc_ptr="*i64", scale="fp32")
            build(ua.kernel_unified_attention, types, constexprs,
                  f"kernel_unified_attention {dtype} segments={segments} block_size={block_size}")
        build(ua.reduce_segments, dict(output_ptr=f"*{dt}", segm_output_ptr="*fp32", segm_max_ptr="*fp32",
                                       segm_expsum_ptr="*fp32"),
              dict(NUM_QUERY_HEADS=9, HEAD_DIM=64, NUM_SEGMENTS=16), f"reduce_segments {dtype}")
        build(rc.reshape_and_cache_kernel_flash, dict(key_ptr=f"*{dt}", value_ptr=f"*{dt}", key_cache_ptr=f"*{dt}",
                                                      value_cache_ptr=f"*{dt}", slot_mapping_ptr="*i64"),
              dict(NUM_KV_HEADS=3, HEADS_PADDED=4, HEAD_DIM=64, BLOCK_SIZE=16), f"reshape_and_cache_flash {dtype}")
    return done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.attention.ops.compile_check",
                                description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 (H100/H200), 80 (A100)")
    p.add_argument("--dtypes", default="bfloat16,float32", help=f"comma-separated subset of {','.join(DTYPES)}")
    a = p.parse_args(argv)
    import triton

    for line in compile_kernels(a.arch, a.dtypes.split(",")):
        print(line, flush=True)
    print(f"triton {triton.__version__}: every variant compiled for sm_{a.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
