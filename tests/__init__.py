"""Galaxy's tests, one folder per package of ``galaxy`` (``tests/core`` for ``galaxy/core``, ...)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: scripts, configs, bench/
# The config of the tests of what a compiled layer saves for backward and how it meets hooks (offload, recompute,
# FSDP units): traced with inductor's decompositions and split by inductor's min-cut partitioner, which make those
# choices, the ops then run eagerly; no kernel is built (about 0.5 s of g++ each on a cold cache). The tests of
# compiled numerics build inductor's (tests/core/test_compile.py).
COMPILED_WITHOUT_KERNELS = dict(compile=True, compile_backend="aot_eager_decomp_partition")
