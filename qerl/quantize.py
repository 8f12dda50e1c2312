"""quantize_(model, config): swap the decoder linears of a causal LM for QuantLinear.

Which modules: q,k,v,o,gate,up,down of every decoder layer (the paper's LoRA targets).
Embeddings, lm_head and the norms stay 16-bit. Fused projections (q,k,v) and (gate,up) share
one NVFP4 global scale, as vLLM expects when it fuses them into one GEMM.
Supported families are named in qerl.arch (SUPPORTED_MODEL_TYPES); anything else is a clear error
rather than a guess from a model name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from qerl import formats, kernels
from qerl.arch import FUSED_GROUPS, LINEAR_NAMES, check_supported
from qerl.qlinear import QuantLinear, base_formats

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class QuantizeConfig:
    """How to turn a dense model into qerl's model (paper Table 4 for the defaults)."""

    fmt: str = formats.QERL_FORMAT  # base weight format: bf16 (BF16-LoRA rows) or a registered format (qerl.formats.names())
    lora_rank: int = 32  # r; paper Table 4 (the official scripts use 16); 0 = no adapter
    lora_alpha: float = 64.0  # scaling = lora_alpha / lora_rank
    lora_dropout: float = 0.0
    targets: tuple[str, ...] = LINEAR_NAMES  # module names inside each decoder layer (qerl.arch)
    fuse_global_scales: bool = True  # (q,k,v) and (gate,up) share one global scale (formats that have one: nvfp4)
    lora_dtype: str = "float32"  # adapter parameter dtype (PEFT's autocast_adapter_dtype keeps fp32)
    backend: str = "auto"  # kernel dispatch: auto | triton | reference | bitsandbytes (nf4)
    progress: bool = False  # show a progress bar over decoder layers

    def __post_init__(self):
        if self.fmt not in base_formats():
            raise ValueError(f"fmt must be one of {base_formats()}, got {self.fmt!r}")
        bad = set(self.targets) - set(LINEAR_NAMES)
        if bad:
            raise ValueError(f"unknown targets {sorted(bad)}; allowed: {LINEAR_NAMES}")
        if self.lora_dtype not in _DTYPES:
            raise ValueError(f"lora_dtype must be one of {tuple(_DTYPES)}, got {self.lora_dtype!r}")
        if self.backend not in kernels.BACKENDS:
            raise ValueError(f"backend must be one of {kernels.BACKENDS}, got {self.backend!r}")
        self.targets = tuple(self.targets)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a supported causal LM, or a ValueError naming what is supported."""
    cfg = getattr(model, "config", None)
    check_supported(getattr(cfg, "model_type", None))
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers at model.layers")
    return layers


def shared_scale_fn(config: QuantizeConfig):
    """The function giving a fused group its shared global scale, or None (bf16, formats
    without a global scale, fuse_global_scales=False)."""
    if formats.is_dense(config.fmt) or not config.fuse_global_scales:
        return None
    return formats.get(config.fmt).fused_global_scale


def quantize_(model: nn.Module, config: QuantizeConfig | None = None) -> dict:
    """Replace the target linears of every decoder layer in place; freeze everything else.

    Returns a report: number of modules replaced and the model size in bytes. Works on the meta
    device too (buffers allocated with the right shapes, nothing computed), which is how the sizes
    of the 7B-32B configs are computed without their weights.
    """
    config = config or QuantizeConfig()
    layers = decoder_layers(model)
    kw = dict(lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
              lora_dtype=_DTYPES[config.lora_dtype], backend=config.backend)
    for p in model.parameters():
        p.requires_grad_(False)
    n = 0
    fuse = shared_scale_fn(config)
    for layer in tqdm(layers, desc=f"quantize {config.fmt}", disable=not config.progress):
        scales = {}
        if fuse is not None:
            for parent, names in FUSED_GROUPS:
                mods = [getattr(getattr(layer, parent), nm) for nm in names if nm in config.targets]
                if mods and mods[0].weight.device.type != "meta":
                    gs = fuse([m.weight.detach() for m in mods])
                    scales.update({id(m): gs for m in mods})
        for parent_name, parent in layer.named_children():
            for name, child in list(parent.named_children()):
                if name not in config.targets:
                    continue
                if not isinstance(child, nn.Linear):
                    raise ValueError(f"{parent_name}.{name} is {type(child).__name__}, expected nn.Linear")
                q = QuantLinear.from_linear(child, config.fmt, global_scale=scales.get(id(child)), **kw)
                setattr(parent, name, q)
                n += 1
    if n == 0:
        raise ValueError(f"no target modules {config.targets} found in the decoder layers")
    model.qerl_quantize_config = dataclasses.asdict(config)
    return {"num_quantized": n, "model_size_bytes": model_size_bytes(model)}


def model_size_bytes(model: nn.Module, include_lora: bool = False) -> int:
    """Bytes of the model's weights as stored (packed buffers count at their packed size).

    This is the paper's "Model Size" column: LoRA adapters are excluded unless asked for, and a
    tied embedding/lm_head counts once.
    """
    total = 0  # named_parameters() yields a tied parameter once
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if (not include_lora and ".lora_" in name) or "rotary_emb" in name:  # inv_freq is not a weight
            continue
        total += t.numel() * t.element_size()
    return total


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable LoRA parameters (marked trainable here: quantize_ freezes everything)."""
    ps = [p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    for p in ps:
        p.requires_grad_(True)
    return ps
