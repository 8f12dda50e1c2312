"""A user's own task, as a TRL user would set it up: a YAML config, a reward function in their own
module, a JSONL dataset with their own column names; trained 2 steps through the CLI (snake_case
flags) and through qerl.train(...). Also: W&B settings from the environment.

Run: python -m pytest tests/test_own_task.py -q      (~1 minute on 2 cores)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qerl.logging import read_metrics, read_wandb_offline

ROOT = Path(__file__).resolve().parent.parent

REWARD_MODULE = '''
def mentions_target(prompts, completions, target, **kwargs):
    """1.0 when the completion contains the row's target word (a column of the user's data)."""
    assert len(prompts) == len(completions) == len(target)
    return [float(t in c.split()) for c, t in zip(completions, target)]


def length_bonus(prompts, completions, **kwargs):
    return [min(len(c.split()), 8) / 8 for c in completions]
'''


def _write_task(tmp: Path, model_dir: Path) -> Path:
    (tmp / "my_rewards.py").write_text(REWARD_MODULE)
    rows = [{"instruction": f"w{i} w{i + 1} w{i + 2}", "target": f"w{i + 3}", "topic": "words"} for i in range(10, 26)]
    (tmp / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "task.yaml").write_text(f"""\
# my own task
model_name_or_path: {model_dir}
method: bf16_lora
dataset: task.jsonl
prompt_column: instruction
answer_column: target
prompt_suffix: ""
reward_funcs: [my_rewards:mentions_target, my_rewards:length_bonus]
reward_weights: [1.0, 0.5]
learning_rate: 1e-3
max_steps: 5
prompts_per_step: 2
num_generations: 4
max_completion_length: 6
per_device_train_batch_size: 8
lora_r: 4
lora_alpha: 8
eval_datasets: []
save_steps: 0
""")
    return tmp / "task.yaml"


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **kw}


def test_own_task_through_the_cli_and_the_api(tmp_path, tiny_llama_dir, monkeypatch):
    cfg_file = _write_task(tmp_path, tiny_llama_dir)
    out = tmp_path / "runs" / "cli"
    r = subprocess.run([sys.executable, "-m", "qerl", "train", "--config", str(cfg_file), "--output_dir", str(out),
                        "--max_steps", "2", "--num_generations", "4", "--report_to", "wandb"],
                       cwd=tmp_path, env=_env(WANDB_MODE="offline"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(out)
    assert [x["step"] for x in rows] == [1, 2]
    for key in ("rewards/mentions_target/mean", "rewards/mentions_target/std", "rewards/length_bonus/mean"):
        assert all(x[key] is not None for x in rows), key
    assert all(abs(x["reward"] - (x["rewards/mentions_target/mean"] + 0.5 * x["rewards/length_bonus/mean"])) < 1e-6
               for x in rows)
    wb = read_wandb_offline(out)
    hist = [h for h in wb["history"] if "train/reward" in h]
    assert [h["train/rewards/mentions_target/mean"] for h in hist] == [x["rewards/mentions_target/mean"] for x in rows]
    assert "train/sampling/sampling_logp_difference/mean" in hist[0] and "sampling/logprob_gap" in rows[0]
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["reward"] == ["my_rewards:mentions_target", "my_rewards:length_bonus"]
    assert recorded["prompt_column"] == "instruction" and recorded["micro_batch_size"] == 8
    assert recorded["learning_rate"] == 1e-3 and recorded["max_steps"] == 2

    # The same task through the Python API: callables and in-memory rows.
    import qerl
    from qerl.config import resolve_config

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    import my_rewards

    data = [json.loads(line) for line in (tmp_path / "task.jsonl").read_text().splitlines()]
    cfg = resolve_config(cfg_file, output_dir=str(tmp_path / "runs" / "api"), max_steps=2)
    summary = qerl.train(cfg, reward_funcs=[my_rewards.mentions_target, my_rewards.length_bonus], train_dataset=data)
    assert summary["status"] == "ok"
    api_rows = read_metrics(tmp_path / "runs" / "api")
    assert [x["step"] for x in api_rows] == [1, 2]
    # same seed, same data, same functions: the same run as the CLI's
    assert [x["rewards/mentions_target/mean"] for x in api_rows] == [x["rewards/mentions_target/mean"] for x in rows]
    assert not (tmp_path / "runs" / "api" / "wandb").exists()


def test_run_config_json_repeats_the_run(tmp_path, tiny_llama_dir):
    """A run folder's config.json passed back as --config gives the same config (less where it writes)."""
    from qerl.config import resolve_config

    cfg_file = _write_task(tmp_path, tiny_llama_dir)
    first = resolve_config(cfg_file, output_dir=str(tmp_path / "a"), seed=3)
    recorded = {**first.to_dict(), "policy": {"fmt": "bf16"}, "provenance": {"git_sha": None}, "world_size": 1}
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    again = resolve_config(tmp_path / "config.json", output_dir=str(tmp_path / "b"))
    assert {**again.to_dict(), "output_dir": None} == {**first.to_dict(), "output_dir": None}


def test_bad_user_input_is_one_line(tmp_path, tiny_llama_dir):
    cfg_file = _write_task(tmp_path, tiny_llama_dir)
    run = lambda *a: subprocess.run([sys.executable, "-m", "qerl", "train", "--config", str(cfg_file), *a],  # noqa: E731
                                    cwd=tmp_path, env=_env(WANDB_MODE="disabled"), capture_output=True, text=True,
                                    timeout=300)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"instruction": "w1", "target": "w2"}) + "\n"
                                        + json.dumps({"instruction": "w3"}) + "\n")
    r = run("--dataset", "bad.jsonl", "--reward", "math_verify", "--output-dir", str(tmp_path / "o1"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "bad.jsonl:2" in r.stderr and "'target'" in r.stderr and "Traceback" not in r.stderr
    r = run("--reward", "my_rewards:nope", "--output-dir", str(tmp_path / "o2"))
    assert r.returncode == 2 and "my_rewards:nope" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = run("--reward", "my_rewards:length_bonus", "--reward_weights", "1", "2", "--output-dir", str(tmp_path / "o2"))
    assert r.returncode == 2 and "2 weights for 1 reward" in r.stderr, r.stderr
    (tmp_path / "typo.yaml").write_text("num_generation: 4\n")
    r = run("--config", str(tmp_path / "typo.yaml"))
    assert r.returncode == 2 and "num_generations" in r.stderr and "typo.yaml" in r.stderr, r.stderr


def _tiny_run(tmp_path, tiny_llama_dir, out, **kw):
    from qerl.config import resolve_config
    from qerl.train import train

    cfg = resolve_config(_write_task(tmp_path, tiny_llama_dir), output_dir=str(out), max_steps=1,
                         dataset=str(tmp_path / "task.jsonl"), reward=("my_rewards:length_bonus",), reward_weights=(),
                         **kw)
    return train(cfg)


def test_wandb_disabled_by_the_environment_writes_no_wandb_files(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    _tiny_run(tmp_path, tiny_llama_dir, tmp_path / "off")
    assert (tmp_path / "off" / "metrics.jsonl").is_file()
    assert not (tmp_path / "off" / "wandb").exists() and not (tmp_path / "off" / "wandb_run_id").exists()


def test_wandb_project_and_tags_reach_the_offline_run(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "myproj")
    monkeypatch.setenv("WANDB_TAGS", "ablation,cpu")
    monkeypatch.setenv("WANDB_RUN_GROUP", "envgroup")
    _tiny_run(tmp_path, tiny_llama_dir, tmp_path / "root1" / "run", seed=2, wandb_group="flaggroup")
    wb = read_wandb_offline(tmp_path / "root1" / "run")
    assert wb["project"] == "myproj"
    assert wb["group"] == "flaggroup"  # an explicit setting wins over WANDB_RUN_GROUP
    assert {"ablation", "cpu", "method:bf16_lora", "format:bf16", "profile:small", "seed:2"} <= set(wb["tags"])
    assert wb["name"] == "root1/run"  # the run root is in the name: runs of two roots do not collide


@pytest.mark.parametrize("mode", ["offline"])
def test_explicit_wandb_mode_wins_over_the_environment(tmp_path, tiny_llama_dir, monkeypatch, mode):
    from qerl.config import resolve_config
    from qerl.logging import wandb_settings

    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = resolve_config(_write_task(tmp_path, tiny_llama_dir), wandb_mode=mode)
    assert wandb_settings(cfg)["wandb_mode"] == mode
    monkeypatch.setenv("WANDB_MODE", "sideways")
    with pytest.raises(ValueError, match="WANDB_MODE"):
        wandb_settings(resolve_config(_write_task(tmp_path, tiny_llama_dir)))
