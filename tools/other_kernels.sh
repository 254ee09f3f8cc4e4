#!/usr/bin/env bash
# Runs the tests marked `numerics` (tests/conftest.py: they compare floating-point results
# with a reference) again on a second CPU kernel path, so that a claim that holds only on this
# machine's kernels fails here, not on the next CPU (issue 38). MKL and oneDNN pick their
# kernels by instruction set, and kernels of different widths block and round differently:
#   a CPU with AVX-512 runs them on the AVX2 path (what an AMD EPYC without AVX-512 runs);
#   a CPU without AVX-512 runs them on the SSE4.2 path.
# On an Intel Xeon with AVX-512 the AVX2 path reproduces the MoE failure an AMD EPYC showed.
# ATen's own kernels (ATEN_CPU_CAPABILITY) are left as the CPU has them: forced below it, the
# compiled steps (inductor, jit_step(compile=True)) came out NaN, a torch artifact, not a CPU.
# Usage: bash tools/other_kernels.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  export MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
else
  export MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41
fi
echo "other_kernels: MKL_ENABLE_INSTRUCTIONS=$MKL_ENABLE_INSTRUCTIONS ONEDNN_MAX_CPU_ISA=$ONEDNN_MAX_CPU_ISA"
exec python -m pytest -q -m numerics "$@"
