"""One training step for every base format (--fmt) with every compute dtype (--dtype), on the CPU: the model
loads in the dtype, the dense (bf16) base is kept in that dtype, and the step runs (rollout, rewards, update).

Run: python -m pytest tests/test_fmt_dtype.py -q      (~30 s on 2 cores)
"""

import json

import pytest

from qerl.config import make_config, table_bases
from qerl.logging import read_metrics
from qerl.train import train

DTYPES = ("bfloat16", "float16", "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", table_bases())
def test_one_step_for_every_fmt_and_dtype(tmp_path, tiny_llama_dir, fmt, dtype, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = make_config("smoke", model=str(tiny_llama_dir), fmt=fmt, lora=True, aqn=False, dtype=dtype,
                      output_dir=str(tmp_path / "run"), max_steps=1, save_every=0, eval_datasets=(),
                      prompts_per_step=1, num_generations=2, micro_batch_size=2, max_completion_length=4,
                      lora_rank=4, lora_alpha=8, wandb_mode="disabled", reward=("official_exact",))
    summary = train(cfg)
    assert summary["status"] == "ok"
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] is not None
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["fmt"] == fmt and recorded["dtype"] == dtype
