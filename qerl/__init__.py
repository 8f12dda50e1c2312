"""qerl: RL (GRPO/DAPO) on LLMs with a 4-bit (NVFP4) base, LoRA and adaptive quantization noise.

The public API (imported lazily, so ``import qerl`` is fast and pulls in nothing heavy):

    cfg = qerl.TrainConfig(model="Qwen/Qwen2.5-0.5B-Instruct", output_dir="runs/mine")  # or make_config
    qerl.train(cfg, reward_funcs=[my_reward], train_dataset=rows)   # TRL-style rewards and data
    model, tok = qerl.load_trained("runs/mine/checkpoints/step-100")  # quantized base + adapter
    qerl.quantize_(hf_model, qerl.QuantizeConfig(fmt=qerl.formats.QERL_FORMAT, lora_rank=32))
    engine = qerl.make_engine(model, tok)                              # the rollout engine

See docs/own-task.md for config files, reward functions, datasets, W&B and adapters.
"""

from __future__ import annotations

import importlib
import logging


def _no_cpu_gemm_warning(record: logging.LogRecord) -> bool:
    """bitsandbytes (imported by peft) warns on every CPU import that an optional kernels-community
    package is missing; qerl never uses that CPU kernel, so that one message is dropped."""
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_no_cpu_gemm_warning)

# name -> (module, attribute); ``train`` is the module qerl.train itself, which is callable
_API = {
    "TrainConfig": ("qerl.config", "TrainConfig"),
    "make_config": ("qerl.config", "make_config"),
    "QuantizeConfig": ("qerl.quantize", "QuantizeConfig"),
    "quantize_": ("qerl.quantize", "quantize_"),
    "make_engine": ("qerl.rollout", "make_engine"),
    "load_trained": ("qerl.trained", "load_trained"),
    "export_trained": ("qerl.trained", "export_trained"),
}

__all__ = sorted([*_API, "train"])


def __getattr__(name: str):
    if name == "train":  # importing the submodule makes it the attribute; qerl.train(cfg, ...) calls train()
        return importlib.import_module("qerl.train")
    if name in _API:
        module, attr = _API[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'qerl' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
