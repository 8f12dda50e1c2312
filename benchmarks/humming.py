"""humming-kernels as the kernel benchmark's optional anchor column (pip install "qerl[bench]"): its
import, the NVRTC library path it needs, and the layer, configs and precompile over qerl's NVFP4 tensors.

humming (vllm-project/humming, Apache-2.0) JIT-compiles Marlin-family W4A16 GEMMs; on sm_90 it
runs warp-specialised WGMMA with TMA and stream-K. It loads compressed-tensors NVFP4 tensors as
qerl exports them: same names (weight_packed, weight_scale, weight_global_scale), same dtypes and
shapes, and it reads weight_global_scale as a divisor as qerl does (it stores 1 / gs as its
weight_scale_2 multiplier). Each (shape, M, mode) is checked against the fp32 product of qerl's
dequantized weight before it is timed, so the column times the same product as qerl's.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from qerl import formats

HUMMING_METHODS = {"humming": False, "humming_batch_invariant": True}  # row method -> use_batch_invariant
HUMMING_MAX_REL_ERR = 2e-2  # bf16 activations and output against the fp32 reference: ~3e-3 when right


def nvrtc_builtins_dirs(paths=None):
    """Folders under <entry>/nvidia/*/lib* of `paths` (default sys.path) holding libnvrtc-builtins:
    where pip's nvidia-cuda-nvrtc (cu12 and cu13 layouts) puts the library NVRTC loads by name."""
    import glob

    dirs = []
    for entry in sys.path if paths is None else paths:
        for lib in sorted(glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib*", "libnvrtc-builtins*.so*"))):
            d = os.path.dirname(os.path.abspath(lib))
            if d not in dirs:
                dirs.append(d)
    return dirs


def prepend_ld_library_path(dirs):
    """Put `dirs` first on LD_LIBRARY_PATH in os.environ; returns those added. Only processes started
    afterwards see it, which is what humming needs: it compiles in a helper subprocess
    (nvrtc_compile) whose libnvrtc dlopens libnvrtc-builtins by name, and a pip-installed NVRTC's
    folder is on no loader path."""
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    new = [d for d in dirs if d not in parts]
    if new:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(new + parts)
    return new


class Humming:
    """humming-kernels as the benchmark uses it: HummingLayer over qerl's NVFP4 tensors, a tuning
    config per M from its heuristics (without one, its first call compiles one kernel per M range,
    28 of them), default (stream-K) and batch-invariant modes."""

    def __init__(self, humming, layer_cls, heuristics, info):
        self.humming, self.layer_cls, self.heuristics, self.info = humming, layer_cls, heuristics, info

    @staticmethod
    def weight_config():
        """The compressed-tensors weights entry qerl exports for nvfp4 (config.json
        quantization_config, config_groups.group_0), with its quant_method and format: what
        HummingLayer(weight_config=...) reads, as its from_safetensors builds it."""
        cfg = formats.get("nvfp4").export_config(["Linear"], [])
        group = cfg["config_groups"]["group_0"]
        return dict(group["weights"], quant_method=cfg["quant_method"], format=group["format"])

    def make_layer(self, t, n, k, steps=None):
        """A transformed HummingLayer [n, k] holding qerl's NVFP4 tensors `t` (CUDA).
        `steps` (a list) gets the name of each call before it runs, for error messages."""
        steps = [] if steps is None else steps
        steps.append("HummingLayer(weight_config=nvfp4-pack-quantized)")
        layer = self.layer_cls(shape_n=n, shape_k=k, weight_config=self.weight_config(),
                               torch_dtype=torch.bfloat16).cuda()
        steps.append("load_from_tensors")
        want = {name: (tuple(p.shape), p.dtype) for name, p in layer.named_parameters()}
        have = {name: (tuple(v.shape), v.dtype) for name, v in t.items()}
        if any(want.get(name) != have[name] for name in have) or not set(want) <= set(have):
            raise ValueError(f"humming expects {want}, qerl's nvfp4 tensors are {have}")
        layer.load_from_tensors({name: v.cuda() for name, v in t.items()})
        steps.append("transform")
        layer.transform()
        return layer

    def configs(self, layer, m, batch_invariant):
        """(compute_config, tuning_config) for one M: the heuristics' single kernel for M."""
        tuning = self.heuristics(layer.humming_config, shape_m=m, use_batch_invariant=batch_invariant)
        return ({"use_batch_invariant": True} if batch_invariant else None), tuning

    def precompile(self, layer, ms):
        """Compile the kernels of every M in `ms` and both modes for one layer shape in parallel
        batches (humming's HummingKernel.prepare_kernels over a list of configs, as its untuned
        first call does) rather than one at a time at each first call. Returns how many."""
        from humming.kernel.humming import HummingKernel

        count = 0
        for bi in HUMMING_METHODS.values():
            uniq = {}
            for m in ms:
                cc, tuning = self.configs(layer, m, bi)
                uniq.setdefault(json.dumps(tuning, sort_keys=True), tuning)
            HummingKernel.prepare_kernels(layer.humming_config.to_str(), cc, [[0, 1 << 30, t] for t in uniq.values()],
                                          torch.cuda.current_device())
            count += len(uniq)
        return count

    @staticmethod
    def describe(tuning):
        """A short name of a tuning config: stream-K or data-parallel, and the block shape."""
        bm, bn, bk = tuning.get("block_shape", (0, 0, 0))
        return f"{'stream-k' if tuning.get('use_stream_k') else 'dp'} {bm}x{bn}x{bk} st{tuning.get('num_stages', '?')}"


def load_humming():
    """(Humming, None) where humming-kernels imports, else (None, why). Puts the folder of the
    libnvrtc-builtins that humming's NVRTC loads on LD_LIBRARY_PATH (see prepend_ld_library_path):
    the folder of the libnvrtc humming picks where that holds one, else pip's nvidia/*/lib folders."""
    try:
        import humming
        from humming.layer import HummingLayer
        from humming.tune import get_heuristics_config
    except Exception as e:  # noqa: BLE001 - absent or broken: the column is skipped, with why
        return None, f"humming-kernels not importable: {type(e).__name__}: {e}"
    info = {"version": getattr(humming, "__version__", None), "nvrtc": None, "ld_library_path_added": []}
    dirs = []
    try:
        from humming.utils.nvrtc import get_nvrtc_library_path

        info["nvrtc"] = get_nvrtc_library_path()
        dirs = nvrtc_builtins_dirs_in(os.path.dirname(info["nvrtc"]))
    except Exception as e:  # noqa: BLE001 - the first compile will fail with humming's own message
        info["nvrtc"] = f"not located: {type(e).__name__}: {e}"
    info["ld_library_path_added"] = prepend_ld_library_path(dirs or nvrtc_builtins_dirs())
    return Humming(humming, HummingLayer, get_heuristics_config, info), None


def nvrtc_builtins_dirs_in(folder):
    """[folder] if it holds a libnvrtc-builtins, else []."""
    import glob

    return [folder] if glob.glob(os.path.join(folder, "libnvrtc-builtins*.so*")) else []
