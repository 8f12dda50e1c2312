#!/usr/bin/env bash
# The 4-bit kernels' and the rollout's measurements (results/kernels, results/rollout) and the GPU test suite
# under both Tritons, on a GPU machine without network reached by calls that each carry at most 64 MiB (the
# working tree included) and return the files written under $OUT. It shares the state of
# scripts/device_reproduce.sh (/tmp/qerl-dev: the wheels, the benchmark data and the embedded model that that
# script's `pack` and calls stage), and adds Triton 3.7.1 (the measurements' Triton) and humming-kernels (the
# reference column of results/kernels).
#
# Here, on the CPU machine:
#   bash scripts/device_reproduce.sh pack     # once: .dev2/env, .dev2/m<i> (the model), .dev2/sha
#   bash scripts/device_measure.sh pack       # .dev2/t1, .dev2/t2 (Triton 3.7.1's package in two parts), .dev2/hum
#   bash scripts/device_reproduce.sh manifest # after any commit (the device checks the tree against it)
# There, the model's calls first if the machine does not hold it (scripts/device_reproduce.sh's header), then
#   bash scripts/device_measure.sh TASK ...   # carrying .dev2/sha, plus .dev2/t1 (and .dev2/hum), then .dev2/t2,
#                                             # until Triton is whole (a call that lacks a part exits 3 at once)
# TASK (several run one after the other; each on its own GPU where it says so):
#   kernels   benchmarks.bench_kernels, 7B layer, M 1..256, humming in the same run (GPU $BENCH_GPU)
#   families  benchmarks.kernel_families at M 1-16: the mma kernel's rule against its X_DIRECT configs
#   rollout   experiments.rollout_throughput, 7B, bf16 and nvfp4: bs1 (2048 tokens) with the rule, with each of
#             QERL_MMA_X_DIRECT, QERL_PRODUCER_LORA_A and QERL_ROPE_LORA_OUT at 16 rows, and with all three;
#             (ROLLOUT_MIX=1) the length mix too
#   profile   benchmarks.profile_decode, nvfp4 bs1 and bs8: kernel time by kind, the rule and all opt-in paths
#   testgpu   make test-gpu under Triton 3.6 (GPU $TEST_GPU_36) and 3.7.1 (GPU $TEST_GPU_37) side by side, with
#             the embedded model; one log each, named by the commit and the Triton
# Every call ends with $OUT/measure.tar.gz (each task's JSON, stdout and logs; unpack anywhere and copy what
# results/ keeps) and $OUT/device.log. Timing tasks run alone on their GPU; run `testgpu` in a later call than
# the timing tasks, not beside them.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/device_reproduce.sh"  # pack, manifest, stage, verify_tree; cd to the root
TRITON_VERSION=3.7.1
HUMMING_VERSION=0.1.19

pack_measure() {
    PY=${PY:-python}
    grep -qx "/$DEV/" .git/info/exclude 2>/dev/null || echo "/$DEV/" >> .git/info/exclude
    tmp=$(mktemp -d)
    tar_xz=${TRITON_TAR:-}
    if [ -z "$tar_xz" ]; then
        # the wheel's package without what a CUDA machine with its own toolkit does not need: the AMD backend,
        # the bundled CUDA binaries and libraries (ptxas comes from TRITON_PTXAS_PATH there), the profiler
        $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$tmp" "triton==$TRITON_VERSION" || return 1
        (cd "$tmp" && $PY -m zipfile -e triton-*.whl w && rm -rf w/triton/backends/amd w/triton/backends/nvidia/bin \
            w/triton/backends/nvidia/lib w/triton/_C/libproton.so w/triton/profiler w/triton/instrumentation w/triton/plugins \
            && { strip --strip-unneeded w/triton/_C/libtriton.so 2>/dev/null || true; } \
            && echo "pack: compressing Triton $TRITON_VERSION (a few minutes)" && tar -cJf triton.tar.xz -C w triton) || return 1
        tar_xz=$tmp/triton.tar.xz
    fi
    rm -rf "$DEV"/t1 "$DEV"/t2 "$DEV"/hum
    mkdir -p "$DEV/t1" "$DEV/t2" "$DEV/hum"
    half=$(( ($(stat -c %s "$tar_xz") + 1) / 2 ))
    split -b "$half" -d -a 1 "$tar_xz" "$tmp/part"
    mv "$tmp/part0" "$DEV/t1/triton.part0" && mv "$tmp/part1" "$DEV/t2/triton.part1"
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$DEV/hum" "humming-kernels==$HUMMING_VERSION" || return 1
    rm -rf "$tmp"
    tree=$(git ls-files -z --cached --others --exclude-standard | du -cB1 --files0-from=- | tail -1 | cut -f1)
    for c in "t1 hum" t2; do
        # shellcheck disable=SC2086
        n=$(du -cB1 $(for d in $c; do echo "$DEV/$d"; done) "$DEV/sha" | tail -1 | cut -f1)
        echo "pack: a call with $c: $(( (tree + n) / 1000 )) kB of $((LIMIT / 1000))"
        [ $((tree + n)) -lt "$LIMIT" ] || { echo "pack: over the call's limit" >&2; return 1; }
    done
}

stage_measure() {
    mkdir -p "$S/tparts"
    for p in "$DEV"/t[12]/triton.part*; do [ -f "$p" ] && cp "$p" "$S/tparts/"; done
    if [ ! -f "$S/triton37/.done" ]; then
        if [ -f "$S/tparts/triton.part0" ] && [ -f "$S/tparts/triton.part1" ]; then
            mkdir -p "$S/triton37" && cat "$S/tparts/triton.part0" "$S/tparts/triton.part1" \
                | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1])" \
                "$S/triton37" && touch "$S/triton37/.done" || { echo "stage: Triton's parts do not unpack" >&2; return 1; }
        else
            echo "stage: Triton $TRITON_VERSION is not whole: parts here: $(ls "$S/tparts" | tr '\n' ' '); carry .dev2/t1 or .dev2/t2" >&2
            return 3
        fi
    fi
    if [ -d "$DEV/hum" ] && [ ! -d "$S/hum/humming" ]; then
        mkdir -p "$S/hum" && (cd "$S/hum" && python3 -m zipfile -e "$OLDPWD"/"$DEV"/hum/humming*.whl .) \
            && chmod +x "$S"/hum/humming/_native/*/* 2>/dev/null
    fi
    [ -f "$S/model/$GGUF" ] || echo "stage: no embedded model in $S/model (scripts/device_reproduce.sh's calls): testgpu runs without it" >&2
    return 0
}

xd_cfg() {  # X_DIRECT's KB and REPS: the families task's fastest on this machine where it ran, else the rule's
    if [ -f "$S/xd_cfg" ]; then
        QERL_MMA_X_DIRECT_CFG=$(cat "$S/xd_cfg"); export QERL_MMA_X_DIRECT_CFG
        echo "X_DIRECT config (KB,REPS): $QERL_MMA_X_DIRECT_CFG (the families task's fastest)"
    fi
}

measure_task() {
    local t=$1 sha=$QERL_GIT_SHA w=$OUT/w
    local t37="env PYTHONPATH=$S/triton37:$S/hum:$S/site:$PWD TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas"
    local t36="env PYTHONPATH=$S/hum:$S/site:$PWD"
    local g=${BENCH_GPU:-0}
    mkdir -p "$w"
    case $t in
    kernels)
        CUDA_VISIBLE_DEVICES=$g $t37 python3 -m benchmarks.bench_kernels --models qwen2.5-7b \
            --m 1 8 16 17 24 32 48 64 96 128 192 256 --grad-m 256 --no-nf4 --git-sha "$sha" --out "$w/kernels" \
            > "$w/kernels.txt" 2>&1; local rc=$?; tail -1 "$w/kernels.txt" | cut -c1-1500; return $rc ;;
    families)
        CUDA_VISIBLE_DEVICES=$g $t37 python3 -m benchmarks.kernel_families --m 1 2 4 8 12 16 --families mma bf16 \
            --mma d1:X_DIRECT=1,KB=1,REPS=1 d1r2:X_DIRECT=1,KB=1,REPS=2 d1r4:X_DIRECT=1,KB=1,REPS=4 d2:X_DIRECT=1,KB=2,REPS=1 d2r2:X_DIRECT=1,KB=2,REPS=2 d1r2w8:X_DIRECT=1,KB=1,REPS=2,num_warps=8 \
            --out "$w/families" > "$w/families.txt" 2>&1; local rc=$?; tail -9 "$w/families.txt" | cut -c1-300
        # the X_DIRECT config fastest over M 1 and 8 (the decode tail) for the rollout task's X_DIRECT variants
        python3 - "$w" "$S" <<'EOF' || true
import glob, json, sys
w, state = sys.argv[1], sys.argv[2]
r = json.load(open(sorted(glob.glob(f"{w}/families/*.json"))[0]))
t = {f: v["1"] + v["8"] for f, v in r["layer_us"].items() if f.startswith("mma:")}
if t:
    best = min(t, key=t.get)
    cfg = r["mma_configs"][best]
    for d in (w, state):  # the state outlives the call: the profile task of a later call reads it too
        open(f"{d}/xd_cfg", "w").write(f"{cfg.get('KB', 1)},{cfg.get('REPS', 1)}")
    print(f"fastest X_DIRECT config over M 1 + 8: {best} {cfg} ({t[best]:.1f} us; the rule: "
          f"{r['layer_us']['mma']['1'] + r['layer_us']['mma']['8']:.1f})")
EOF
        return $rc ;;
    rollout)
        # the rule, then the opt-in paths: mma X_DIRECT up to 16 rows, o_proj's LoRA A in the attention launch
        local r="python3 -m experiments.rollout_throughput --models qwen2.5-7b --methods bf16 nvfp4 --git-sha $sha" rc=0
        xd_cfg
        local variants="rule:QERL_MMA_X_DIRECT=0 xd16:QERL_MMA_X_DIRECT=16 prod16:QERL_PRODUCER_LORA_A=16 rope16:QERL_ROPE_LORA_OUT=16 all:QERL_MMA_X_DIRECT=16,QERL_PRODUCER_LORA_A=16,QERL_ROPE_LORA_OUT=16"
        for v in $variants; do
            local name=${v%%:*} envs
            envs=$(echo "${v#*:}" | tr ',' ' ')
            # shellcheck disable=SC2086
            CUDA_VISIBLE_DEVICES=$g env $envs $t37 $r --batch 1 --completion 2048 --out "$w/rollout_bs1_$name" \
                > "$w/rollout_bs1_$name.txt" 2>&1 || rc=$?
            echo "bs1 $name: $(tail -1 "$w/rollout_bs1_$name.txt" | cut -c1-400)"
            if [ "${ROLLOUT_MIX:-0}" = 1 ]; then
                # shellcheck disable=SC2086
                CUDA_VISIBLE_DEVICES=$g env $envs $t37 $r --batch 64 --lengths mix --completion 2048 \
                    --out "$w/rollout_mix_$name" > "$w/rollout_mix_$name.txt" 2>&1 || rc=$?
                echo "mix $name: $(tail -1 "$w/rollout_mix_$name.txt" | cut -c1-400)"
            fi
        done
        return $rc ;;
    profile)
        # where a bs1 / bs8 decode step's time goes, by kernel kind, with the rule and with all opt-in paths
        local rc=0
        xd_cfg
        for v in rule:QERL_MMA_X_DIRECT=0 all:QERL_MMA_X_DIRECT=16,QERL_PRODUCER_LORA_A=16,QERL_ROPE_LORA_OUT=16; do
            local name=${v%%:*} envs
            envs=$(echo "${v#*:}" | tr ',' ' ')
            # shellcheck disable=SC2086
            CUDA_VISIBLE_DEVICES=$g env $envs $t37 QERL_GIT_SHA=$sha python3 -m benchmarks.profile_decode --batch 1 8 \
                --methods nvfp4 --out "$w/profile_$name" > "$w/profile_$name.txt" 2>&1 || rc=$?
            echo "profile $name: $(grep -h "ms a step\|wall" "$w/profile_$name.txt" | head -4 | tr '\n' ' ' | cut -c1-400)"
        done
        return $rc ;;
    testgpu)
        local model="" rc=0
        [ -f "$S/model/$GGUF" ] && model="QERL_SMOLLM2_GGUF=$S/model/$GGUF"
        # shellcheck disable=SC2086
        (CUDA_VISIBLE_DEVICES=${TEST_GPU_36:-1} $t36 $model QERL_GIT_SHA=$sha timeout 560 make test-gpu PY=python3 \
            GPU_LOG="$w/h200_${sha:0:7}_triton3.6.log" > /dev/null 2>&1) &
        local p36=$!
        # shellcheck disable=SC2086
        (CUDA_VISIBLE_DEVICES=${TEST_GPU_37:-2} $t37 $model QERL_GIT_SHA=$sha timeout 560 make test-gpu PY=python3 \
            GPU_LOG="$w/h200_${sha:0:7}_triton3.7.1.log" > /dev/null 2>&1) &
        wait $p36 || rc=$?
        wait $! || rc=$?
        tail -n 2 "$w"/h200_*_triton3.6.log "$w"/h200_*_triton3.7.1.log
        return $rc ;;
    *) echo "unknown task $t (kernels | families | rollout | profile | testgpu)" >&2; return 2 ;;
    esac
}

measure() {
    : "${OUT:?OUT is not set (the device sets it)}"
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled QERL_CACHE="$S/cache" QERL_DATA_DIR="$S/data"
    stage || { rc=$?; [ "$rc" = 3 ] && [ -f "$S/site/.done" ] || return $rc; }  # the model may be absent
    stage_measure || return $?
    [ "$*" = stage ] && { echo "staged: Triton $TRITON_VERSION in $S/triton37"; return 0; }
    verify_tree || return $?
    local rc=0
    for t in "$@"; do
        [ "$t" = stage ] && continue
        echo "== $t ($(date -u +%T))"
        measure_task "$t" || { echo "$t: exit $?"; rc=1; }
    done
    tar -czf "$OUT/measure.tar.gz" -C "$OUT" w && rm -rf "$OUT/w"
    ls -la "$OUT"
    return $rc
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0
case "${1:-}" in
pack) pack_measure ;;
""|-h|--help) sed -n '2,28p' "$0"; exit 2 ;;
*)
    mkdir -p "${OUT:-/tmp/qerl-dev/out}"
    OUT=${OUT:-/tmp/qerl-dev/out}
    measure "$@" 2>&1 | tee "$OUT/device.log"
    exit "${PIPESTATUS[0]}" ;;
esac
