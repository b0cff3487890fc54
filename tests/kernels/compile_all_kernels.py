"""Compile every galaxy Triton kernel ahead of time for a CUDA target, on a machine
without a GPU. Run as a script (TRITON_INTERPRET must be off, so not in-process with the
interpreter tests). Prints one ``OK <name>`` or ``FAIL <name>: <error>`` line per kernel.

The interpreter accepts code the real compiler rejects (loop-carried type changes, early
returns, dtype mixes), so this catches what the CPU tests cannot.
"""

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from galaxy.kernels import triton_cross_entropy as ce  # noqa: E402
from galaxy.kernels import triton_norms as norms  # noqa: E402
from galaxy.kernels import triton_rope as rope  # noqa: E402
from galaxy.kernels import triton_swiglu as swiglu  # noqa: E402


def _compile(fn, types, constexprs, num_warps, target):
    # Arguments not listed are integer scalars (strides, sizes).
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names
    }
    return triton.compile(ASTSource(fn, signature, constexprs), target=target, options={"num_warps": num_warps})


def cases():
    for dt in ("fp32", "bf16"):
        p = f"*{dt}"
        f32 = "*fp32"
        yield f"rms_fwd_{dt}", norms._rms_norm_fwd_kernel, dict(X=p, W=p, Y=p, RSTD=f32, eps="fp32"), {"BLOCK_N": 4096}, 8
        yield (f"rms_bwd_{dt}", norms._rms_norm_bwd_kernel, dict(DY=p, X=p, W=p, RSTD=f32, DX=p, DW_PARTIAL=f32),
               {"BLOCK_N": 4096, "STAGES": norms.BWD_STAGES}, 8)
        yield (f"ln_fwd_{dt}", norms._layer_norm_fwd_kernel,
               dict(X=p, W=p, B=p, Y=p, MEAN=f32, RSTD=f32, eps="fp32"), {"BLOCK_N": 1024}, 4)
        yield (f"ln_bwd_{dt}", norms._layer_norm_bwd_kernel,
               dict(DY=p, X=p, W=p, MEAN=f32, RSTD=f32, DX=p, DW_PARTIAL=f32, DB_PARTIAL=f32),
               {"BLOCK_N": 1024, "STAGES": norms.BWD_STAGES}, 4)
        yield (f"sum_partials_{dt}", norms._sum_partials_kernel, dict(P=f32, OUT=p, OUT2=f32),
               {"BLOCK_P": 64, "BLOCK_C": 32}, 4)
        for inverse in (False, True):
            for half_table in (False, True):
                yield (f"rope_{'bwd' if inverse else 'fwd'}{'_half_table' if half_table else ''}_{dt}",
                       rope._rope_kernel, dict(Q=p, K=p, COS=p, SIN=p, QO=p, KO=p),
                       {"INVERSE": inverse, "POSITIONS": 2, "BLOCK_QH": 32, "BLOCK_KH": 8, "BLOCK_D": 64,
                        "HALF_TABLE": half_table}, 16)
        for flat in (True, False):
            yield (f"swiglu_fwd_{'flat' if flat else '2d'}_{dt}", swiglu._swiglu_fwd_kernel, dict(G=p, U=p, Y=p),
                   {"FLAT": flat, "BLOCK_SIZE": 2048}, 8)
            yield (f"swiglu_bwd_{'flat' if flat else '2d'}_{dt}", swiglu._swiglu_bwd_kernel,
                   dict(DY=p, G=p, U=p, DG=p, DU=p), {"FLAT": flat, "BLOCK_SIZE": 2048}, 8)
        for write_grad in (False, True):
            yield (f"ce_fwd{'_grad' if write_grad else ''}_{dt}", ce._ce_fwd_kernel,
                   dict(LOGITS=p, GRAD=p, TARGETS="*i64", LOSS=f32, DENOM=f32),
                   {"WRITE_GRAD": write_grad, "BLOCK_V": 16384}, 16)
        yield f"scale_rows_{dt}", ce._scale_rows_kernel, dict(X=p, G=f32), {"BLOCK": 4096}, 4


def main(arch: int = 90) -> int:
    target = GPUTarget("cuda", arch, 32)
    failures = 0
    for name, fn, types, constexprs, num_warps in cases():
        try:
            kernel = _compile(fn, types, constexprs, num_warps, target)
            assert "cubin" in kernel.asm or "ptx" in kernel.asm
            print(f"OK {name}")
        except Exception as err:  # noqa: BLE001 - report every kernel, then fail
            failures += 1
            print(f"FAIL {name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90))
