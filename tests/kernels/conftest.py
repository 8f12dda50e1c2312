"""Kernel tests: on a machine without CUDA, run the Triton kernels in the interpreter.

TRITON_INTERPRET is read when triton.jit decorates a kernel, i.e. when a kernel module of qerl.kernels
is first imported, so it must be set here, before any test module imports it.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes minutes")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
