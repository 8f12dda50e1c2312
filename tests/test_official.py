"""The official QeRL code's settings as the `official` profile, and its GSM8K reward (`--reward official_exact`).

Run: python -m pytest tests/test_official.py -q      (CPU, seconds)
"""

import argparse

import pytest

from qerl import rewards as qrewards
from qerl.cli_train import add_train_args, config_from_args
from qerl.config import make_config


def test_official_exact_is_the_2025_11_27_reward():
    """NVlabs/QeRL's GSM8K reward since e8c6e79 (2025-11-27): 2.0 for the exact answer inside the answer
    tags, plus 0.2 (format_reward_weight) for the think and answer tags."""
    completions = [
        "<think> 40 + 2 </think> <answer> 42 </answer>",  # right, with both tags
        "<answer>42</answer>",  # right, no think block
        "<think>x</think><answer>42.0</answer>",  # math-verify would accept 42.0; the exact match does not
        "<think>x</think><answer>\\boxed{42}</answer>",
        "42",  # no tags: the whole text is the answer (the official extract_xml_answer)
        "<answer>41</answer><answer>42</answer>",  # the last tag wins
        "<think></think><answer>7</answer>",  # an empty think block earns no format reward
        "<think>x</think> 7",  # a think block without the answer tags earns none either
        "<think>x</think><answer></answer>",  # nor an empty answer block
    ]
    res = qrewards.score_batch(completions, ["42"] * 6 + ["7"] * 3, reward="official_exact")
    assert res.rewards == [2.0, 2.0, 0.0, 0.0, 2.0, 2.0, 2.0, 0.0, 0.0]
    assert res.format == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert res.unparsed == 2  # "42" and "<think>x</think> 7" have no <answer>
    w = make_config("smoke", reward="official_exact").format_reward_weight
    total = [r + w * f for r, f in zip(res.rewards, res.format)]  # what the trainer adds up (qerl.step.score)
    assert total[:3] == [pytest.approx(2.2), 2.0, pytest.approx(0.2)]
    mv = qrewards.score_batch(completions[:3], ["42"] * 3)  # the default, math_verify, for contrast
    assert mv.rewards == [1.0, 1.0, 1.0]
    assert qrewards.score_batch(["<answer>18</answer>"], [18.0], reward="official_exact").rewards == [2.0]
    with pytest.raises(ValueError, match="reward must be one of"):
        qrewards.score_batch(["x"], ["1"], reward="exact")


def test_reward_choice_and_its_format_weight():
    assert make_config("smoke").reward == ("math_verify",) and make_config("smoke").format_reward_weight == 0.0
    cfg = make_config("smoke", reward="official_exact")
    assert cfg.format_reward_weight == pytest.approx(0.2)
    assert make_config("smoke", reward="official_exact", format_reward_weight=0.5).format_reward_weight == 0.5
    with pytest.raises(ValueError, match="expected a built-in"):
        make_config("smoke", reward="exact")
    p = argparse.ArgumentParser()
    add_train_args(p)
    assert config_from_args(p.parse_args(["--profile", "smoke", "--reward", "official_exact"])).reward == ("official_exact",)
    assert config_from_args(p.parse_args(["--profile", "smoke", "--format-reward-weight", "0.3"])).format_reward_weight == 0.3
    with pytest.raises(ValueError, match="module:function"):
        config_from_args(p.parse_args(["--reward", "exact"]))


def test_official_profile_has_the_official_scripts_settings():
    """What training/dapo_qwen2.5-*_single_gpu.sh run: loss_type="bnpo" takes their `if loss_type == bnpo`
    branch (rl_mode dapo: beta 0, epsilon_high 0.28, num_iterations 1), not the rl_mode="grpo" values."""
    c = make_config("official", method="nvfp4_lora_aqn")
    want = dict(lora_rank=16, lora_alpha=16, max_grad_norm=0.2, weight_decay=0.1, adam_beta2=0.99, warmup_ratio=0.1,
                lr_scheduler="cosine", mask_truncated_completions=True, loss_type="bnpo", beta=0.0, epsilon_high=0.28,
                train_norms=True, reward=("official_exact",), format_reward_weight=0.2, sigma_start=1e-2,
                sigma_end=1e-4, num_stages=10, learning_rate=1e-5, num_iterations=1, max_completion_length=2048,
                dataset="gsm8k")
    assert {k: getattr(c, k) for k in want} == want
    assert make_config("official", method="bf16_lora").learning_rate == 5e-6
    paper = make_config("paper")  # the paper profile stays Table 4
    assert (paper.lora_rank, paper.reward, paper.train_norms, paper.beta) == (32, ("math_verify",), False, 0.0)


def test_official_profile_trains_end_to_end_on_a_tiny_model(tmp_path, tiny_llama_dir):
    """The scripts' unused GRPO branch by flags (beta 0.04: the reference with adapters off and the initial
    norms), trained norms, official reward, masked truncated completions: two steps on the CPU."""
    import json

    from qerl.train import train

    cfg = make_config("official", model=str(tiny_llama_dir), method="nvfp4_lora_aqn", optim="adamw", dataset="arith",
                      eval_datasets=(), max_steps=2, num_stages=2, prompts_per_step=2, num_generations=4,
                      max_completion_length=6, micro_batch_size=8, max_prompt_length=512, gradient_checkpointing=False,
                      loss_type="grpo", beta=0.04, epsilon_high=0.2,
                      wandb_mode="disabled", save_every=0, output_dir=str(tmp_path / "run"))
    assert train(cfg)["status"] == "ok"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["kl"] is not None for r in rows)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["policy"]["trainable_norms"] == 4
