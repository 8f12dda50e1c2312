#!/bin/sh
# Install torch 2.13.0 for this machine and say which build it is. Used by `make setup`.
#   - torch already importable: keep it (a CUDA build you chose stays).
#   - Linux with an NVIDIA driver (nvidia-smi works): the default PyPI wheel, the CUDA build.
#   - macOS: the PyPI wheel (CPU / Apple GPU; there are no CUDA libraries for macOS).
#   - otherwise (Linux, no CUDA): the CPU wheel from PyTorch's CPU index, so no nvidia-* / cuda
#     packages are pulled. If that index cannot be reached (offline mirrors), plain torch==2.13.0
#     from the configured index, and a warning if that brought the CUDA build.
set -eu
PY=${PY:-python3}
VERSION=${TORCH_VERSION:-2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu

if $PY -c "import torch" 2>/dev/null; then
    $PY -W ignore -c "import torch; print(f'setup: torch {torch.__version__} already installed (CUDA build: {torch.version.cuda or \"no\"}); keeping it')"
    exit 0
fi
if [ "$(uname -s)" = "Linux" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing the CUDA build of torch==$VERSION from PyPI"
    $PY -m pip install "torch==$VERSION"
elif [ "$(uname -s)" = "Darwin" ]; then
    echo "setup: macOS: installing torch==$VERSION from PyPI (CPU / Apple GPU build, no CUDA)"
    $PY -m pip install "torch==$VERSION"
elif $PY -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=10)" >/dev/null 2>&1; then
    echo "setup: no CUDA: installing the CPU build of torch==$VERSION from $CPU_INDEX (no CUDA libraries)"
    $PY -m pip install "torch==$VERSION" --index-url "$CPU_INDEX"
else
    echo "setup: no CUDA, and $CPU_INDEX is unreachable: installing torch==$VERSION from the configured index"
    $PY -m pip install "torch==$VERSION"
fi
$PY -W ignore -c "import torch; c = torch.version.cuda; print(f'setup: installed torch {torch.__version__}: ' + (f'CUDA {c} build' if c else 'CPU build (no CUDA libraries)'))"
if [ "$(uname -s)" = "Linux" ] && ! command -v nvidia-smi >/dev/null 2>&1 \
        && $PY -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then
    echo "setup: warning: this is the CUDA build on a machine without CUDA (the CPU index was unreachable);" \
         "it works on the CPU but pulled the nvidia-* packages. For the CPU build:" \
         "pip uninstall -y torch && pip install torch==$VERSION --index-url $CPU_INDEX"
fi
