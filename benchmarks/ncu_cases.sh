#!/bin/sh
# Nsight Compute on fp4_mma launches of the 7B shapes (issue 14: what bounds each M), next to cuBLAS.
#   sh benchmarks/ncu_cases.sh OUT_DIR     (on a GPU machine with ncu; writes OUT_DIR/ncu_mma.txt)
set -u
OUT=${1:-.}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECTIONS="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis"
run() {  # name, kernel regex, args...
    name=$1; k=$2; shift 2
    echo "=== $name" >>"$OUT/ncu_mma.txt"
    PYTHONPATH=$PWD "$NCU" --clock-control none $SECTIONS -k "regex:$k" --launch-skip 8 --launch-count 1 \
        python3 -m benchmarks.ncu_mma "$@" >>"$OUT/ncu_mma.txt" 2>&1
}
W64='{"BM":64,"KB":1,"REPS":1,"num_warps":4,"PREFETCH":false,"STAGES":4,"WGMMA":true,"W_RING":true}'
W64_8='{"BM":64,"KB":1,"REPS":1,"num_warps":8,"PREFETCH":false,"STAGES":4,"WGMMA":true,"W_RING":true}'
run gate_M64_rule _mma_kernel --n 18944 --k 3584 --m 64
run gate_M64_split2 _mma_kernel --n 18944 --k 3584 --m 64 --split 2
run gate_M64_8warps _mma_kernel --n 18944 --k 3584 --m 64 --cfg "$W64_8"
run gate_M256_rule _mma_kernel --n 18944 --k 3584 --m 256
run gate_M128_rule _mma_kernel --n 18944 --k 3584 --m 128
run gate_M16_rule _mma_kernel --n 18944 --k 3584 --m 16
run gate_M1_rule _mma_kernel --n 18944 --k 3584 --m 1
run k_M64_rule _mma_kernel --n 512 --k 3584 --m 64
run gate_M64_bf16 'nvjet|gemm|gemv' --n 18944 --k 3584 --m 64 --bf16
