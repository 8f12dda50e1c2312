"""Your own task through the installed `qerl` command, as a user runs it: from a folder that holds the reward
module, the data file (its own column names) and the YAML config; no PYTHONPATH to that folder.

The command is the console script `pip install -e .` puts next to the interpreter (CI installs it so); the
tests skip, saying so, where it is not installed. PYTHONPATH holds this checkout only, so that the script runs
this code: the reward module is still found only through the working folder.

Run: python -m pytest tests/test_console_script.py -q      (tiny random model, CPU, ~2 minutes on 2 cores)
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qerl.logging import read_metrics

ROOT = Path(__file__).resolve().parent.parent

_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)

REWARDS = '''
def exact_count(prompts, completions, vowel_count, **kwargs):
    """1.0 when the completion names the row's count (the user's own column, one value per completion)."""
    assert len(prompts) == len(completions) == len(vowel_count)
    return [float(f"w{v}" in c.split()) for c, v in zip(completions, vowel_count)]


def short(prompts, completions, **kwargs):
    return [1.0 - min(len(c.split()), 6) / 6 for c in completions]
'''


def qerl_command() -> str | None:
    """The installed `qerl` script: next to this interpreter (a virtual environment), else on PATH."""
    here = Path(sys.executable).parent / "qerl"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("qerl")


@pytest.fixture(scope="module")
def qerl_cmd():
    cmd = qerl_command()
    if cmd is None:
        pytest.skip("the `qerl` console script is not installed (pip install -e . installs it; CI does)")
    return cmd


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A folder as a user has it: my_rewards.py, tasks.jsonl (question_text, vowel_count), cfg.yaml."""
    d = tmp_path_factory.mktemp("vowels")
    model = d / "tiny-model"
    _conftest.make_tiny_model("llama").save_pretrained(model)
    _conftest.make_tiny_tokenizer().save_pretrained(model)
    (d / "my_rewards.py").write_text(REWARDS)
    rows = [{"question_text": f"w{i} w{i + 7} w{i + 3}", "vowel_count": i % 5 + 1} for i in range(10, 26)]
    (d / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "cfg.yaml").write_text(f"""\
model_name_or_path: {model}
method: bf16_lora
dataset: tasks.jsonl
prompt_column: question_text
answer_column: vowel_count
prompt_suffix: ""
reward_funcs: [my_rewards:exact_count, my_rewards:short]
reward_weights: [1.0, 0.2]
learning_rate: 1e-3
max_steps: 2
prompts_per_step: 2
num_generations: 4
max_completion_length: 4
per_device_train_batch_size: 8
lora_r: 4
lora_alpha: 8
eval_datasets: [tasks.jsonl]   # evaluated with the columns above
eval_limit: 4
eval_samples: 1
eval_max_completion_length: 3
report_to: none
output_dir: runs/vowels
""")
    return d


def run(cmd, task, *args, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(ROOT), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    return subprocess.run([*([cmd] if isinstance(cmd, str) else cmd), *map(str, args)], cwd=task, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(qerl_cmd, task):
    r = run(qerl_cmd, task, "train", "--config", "cfg.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    return task / "runs" / "vowels"


def test_train_from_the_folder_of_the_reward_module(trained):
    """`qerl train --config cfg.yaml`: the reward module imports from the working folder, each function is
    logged, and the run's evaluation file is read with the config's column names."""
    rows = [r for r in read_metrics(trained) if r.get("reward") is not None]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("rewards/exact_count/mean", "rewards/exact_count/std", "rewards/short/mean"):
        assert all(r[key] is not None for r in rows), key
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["eval_before/tasks.jsonl/num_problems"] == 4 and summary["eval/tasks.jsonl/num_problems"] == 4
    # the evaluation file is scored by the run's reward functions, as the training steps are
    assert {"eval/tasks.jsonl/rewards/exact_count/mean", "eval/tasks.jsonl/rewards/short/mean"} <= set(summary)
    assert (trained / "checkpoints" / "step-2" / "trainable.safetensors").is_file()


def test_eval_on_your_own_columns(qerl_cmd, task, trained):
    ck = trained / "checkpoints" / "step-2"
    r = run(qerl_cmd, task, "eval", "--adapter", ck, "--dataset", "tasks.jsonl", "--prompt-column", "question_text",
            "--answer-column", "vowel_count", "--limit", "3", "--max-new-tokens", "3", "--greedy", "--engine", "hf",
            "--out", "eval.json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tasks.jsonl: pass@1 " in r.stdout and "3 problems x 1 samples" in r.stdout, r.stdout
    res = json.loads((task / "eval.json").read_text())
    assert res["results"]["tasks.jsonl"]["samples"] == 1 and res["settings"]["samples"] == 1  # greedy: one sample
    # the same from the config file: its columns, prompt suffix and model
    r = run(qerl_cmd, task, "eval", "--config", "cfg.yaml", "--adapter", ck, "--limit", "2", "--greedy",
            "--engine", "hf")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tasks.jsonl: pass@1 " in r.stdout and "2 problems x 1 samples" in r.stdout, r.stdout
    # without the columns the one line names the flag eval takes
    r = run(qerl_cmd, task, "eval", "--adapter", ck, "--dataset", "tasks.jsonl", "--limit", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--prompt-column" in r.stderr, r.stderr


def test_eval_scores_your_task_with_your_reward_functions(qerl_cmd, task, trained):
    """`qerl eval` scores your own data with the reward functions (and weights) of training, from the config
    or the flags: each function's mean, and pass@1 as the mean weighted reward, equal to scoring the same
    completions by hand."""
    spec = importlib.util.spec_from_file_location("_task_rewards", task / "my_rewards.py")
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)
    ck = trained / "checkpoints" / "step-2"
    for name, flags, funcs, weights in [
        ("config", ["--config", "cfg.yaml"], [mine.exact_count, mine.short], [1.0, 0.2]),
        ("flags", ["--dataset", "tasks.jsonl", "--prompt-column", "question_text", "--prompt-suffix", "",
                   "--reward", "my_rewards:short", "--reward-weights", "0.5"], [mine.short], [0.5]),
    ]:
        r = run(qerl_cmd, task, "eval", "--adapter", ck, *flags, "--limit", "4", "--greedy", "--engine", "hf",
                "--max-new-tokens", "4", "--out", f"own-{name}.json")
        assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads((task / f"own-{name}.json").read_text())["results"]["tasks.jsonl"]
        rows = [c["row"] for c in res["completions"]]
        texts = [c["completion"] for c in res["completions"]]
        assert len(texts) == 4 and res["unparsed"] == 0
        columns = {k: [row["columns"][k] for row in rows] for k in rows[0]["columns"]}
        total = [0.0] * len(texts)
        for f, w in zip(funcs, weights):
            vals = f([row["prompt"] for row in rows], texts, **columns)
            assert res[f"rewards/{f.__name__}/mean"] == pytest.approx(sum(vals) / len(vals)), name
            assert f"{f.__name__} {sum(vals) / len(vals):.4f}" in r.stdout, r.stdout
            total = [t + w * v for t, v in zip(total, vals)]
        assert res["accuracy"] == pytest.approx(sum(total) / len(total)) and res["reward"] == res["accuracy"]
        assert "tasks.jsonl: pass@1 (mean weighted reward) " in r.stdout, r.stdout
    assert "rewards/exact_count/mean" not in res  # the flags' functions replace the checkpoint's


def test_generate_from_your_own_dataset(qerl_cmd, task, trained):
    r = run(qerl_cmd, task, "generate", "--adapter", trained / "checkpoints" / "step-2", "--config", "cfg.yaml",
            "--dataset", "tasks.jsonl", "--limit", "2", "--max-new-tokens", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(">>> w") == 2 and len(json.loads(r.stdout.strip().splitlines()[-1])["completions"]) == 2


def test_an_abbreviated_flag_is_one_line(qerl_cmd, task):
    r = run(qerl_cmd, task, "train", "--config", "cfg.yaml", "--max-step", "3", "--output-dir", "runs/abbrev")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: unrecognized arguments: --max-step ") and "did you mean --max-steps?" in r.stderr
    assert "(see: qerl train --help)" in r.stderr and not (task / "runs" / "abbrev").exists()


def test_resume_auto_in_an_empty_output_dir_says_so(qerl_cmd, task):
    """The documented choice: no checkpoint to resume from -> one line, then a run from step 1."""
    r = run(qerl_cmd, task, "train", "--config", "cfg.yaml", "--resume-from", "auto", "--output-dir", "runs/fresh",
            "--max-steps", "1", "--eval-datasets", "none")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if "no checkpoint" in ln]
    assert lines == [f"[qerl] --resume-from auto: no checkpoint in {Path('runs/fresh/checkpoints')}; starting at step 1"]
    assert [x["step"] for x in read_metrics(task / "runs" / "fresh")] == [1]


def test_torchrun_of_the_installed_command_finds_the_reward_module(qerl_cmd, task):
    """torchrun --no-python qerl ...: the workers start from the script's folder, not the working one."""
    r = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--no-python",
             qerl_cmd], task, "train", "--config", "cfg.yaml", "--output-dir", "runs/torchrun", "--max-steps", "1",
            "--eval-datasets", "none")
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_metrics(task / "runs" / "torchrun")[0]["rewards/exact_count/mean"] is not None
