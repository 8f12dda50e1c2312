"""The `upstream` profile (what NVlabs/QeRL's GSM8K scripts run at e8c6e79; docs/upstream.md): its settings,
its reward, `qerl train --dry-run`, and the accumulating bf16 noise of aqn_mode="upstream" on a tiny CPU model.

    .venv/bin/python -m pytest tests/test_upstream.py -q
"""

import json

import pytest
import torch

from qerl import noise as qnoise
from qerl import rewards as qrewards
from qerl.config import describe, make_config


def test_upstream_profile_pins_the_scripts_settings():
    """training/dapo_qwen2.5-7b_nvfp4_single_gpu.sh: perdevice_train_batch_size=2 = --num-generations, gradient
    accumulation 1 (1 prompt x 2 completions, one optimizer step), --num-train-epochs 1; utils/data.py (4de3ce6):
    the bare question; qerl.py (e8c6e79): soft format 0.2 + exact answer 2.0; noise_scheduler.py: in place."""
    c = make_config("upstream")
    want = dict(prompts_per_step=1, num_generations=2, mini_batch_size=0, micro_batch_size=2, num_iterations=1,
                num_train_epochs=1.0, prompt_suffix="", chat_template=True, reward=("upstream",),
                format_reward_weight=0.2, aqn=True, aqn_mode="upstream", fmt="nvfp4", lora=True, dataset="gsm8k",
                lora_rank=16, lora_alpha=16, learning_rate=1e-5, adam_beta2=0.99, weight_decay=0.1, warmup_ratio=0.1,
                lr_scheduler="cosine", max_grad_norm=0.2, optim="adamw_8bit", max_prompt_length=256,
                max_completion_length=2048, loss_type="bnpo", beta=0.0, epsilon=0.2, epsilon_high=0.28,
                mask_truncated_completions=True, train_norms=True, sigma_start=1e-2, sigma_end=1e-4, num_stages=10,
                noise_schedule="exponential", save_every=50, save_total_limit=5)
    assert {k: getattr(c, k) for k in want} == want
    assert c.rollout_batch_size == 2
    assert make_config("upstream", method="bf16_lora").learning_rate == 5e-6  # dapo_qwen2.5-7b_bf16_single_gpu.sh
    for other in ("small", "paper", "official"):  # opt-in: no other profile changes
        o = make_config(other)
        assert (o.aqn_mode, o.num_train_epochs) == ("restored", 0.0)
        assert "upstream" not in o.reward


def test_describe_and_dry_run_show_the_recipe(capsys):
    from qerl.cli import main

    text = "\n".join(describe(make_config("upstream")))
    assert "batch: 1 prompt x 2 completions a step" in text and "1 epoch over the training set" in text
    assert "prompt: the bare question" in text
    assert qrewards.UPSTREAM_FORMAT_PATTERN in text and "mode upstream" in text
    assert main(["train", "--profile", "upstream", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert text in out
    cfg = json.loads(out[:out.rindex("}") + 1])
    assert (cfg["prompts_per_step"], cfg["num_generations"], cfg["num_train_epochs"], cfg["prompt_suffix"]) == (1, 2, 1.0, "")
    assert "batch: 16 prompts x 8 completions" in "\n".join(describe(make_config("paper")))


@pytest.mark.parametrize("text, fmt", [
    ("<think>a</think> <answer>18</answer>", 1.0),
    ("<think></think>\n<answer></answer>", 1.0),  # empty blocks count upstream
    ("intro <think>x</think>\n\n<answer>18</answer> trailing", 1.0),  # searched anywhere
    ("<think>x</think> so <answer>18</answer>", 0.0),  # only whitespace between the blocks
    ("<think>x\ny</think><answer>1\n8</answer>", 1.0),  # DOTALL
    ("<answer>18</answer>", 0.0),
])
def test_upstream_format_regex(text, fmt):
    assert qrewards.score_batch([text], ["18"], reward="upstream").format == [fmt]
    # the project's official_exact differs on empty blocks and on text between the blocks
    if text in ("<think></think>\n<answer></answer>", "<think>x</think> so <answer>18</answer>"):
        assert qrewards.score_batch([text], ["18"], reward="official_exact").format == [1.0 - fmt]


def test_upstream_reward_values():
    comps = ["<think>t</think> <answer>18</answer>", "<think>t</think> <answer> 18 </answer>", "<answer>17</answer>",
             "18", "the answer is 18"]
    res = qrewards.score_batch(comps, ["18"] * 5, reward="upstream")
    assert res.rewards == [2.0, 2.0, 0.0, 2.0, 0.0]  # no tag: the whole completion, stripped, is the answer
    assert res.format == [1.0, 1.0, 0.0, 0.0, 0.0]
    cfg = make_config("smoke", reward="upstream")
    rs = qrewards.RewardSet.from_config(cfg)
    comp, _ = rs(["q"] * 2, comps[:2], {"answer": ["18", "19"]})
    total = [sum(w * v for w, v in zip(rs.weights, row)) for row in comp]
    assert total == pytest.approx([2.2, 0.2])


# ---------------------------------------------------------------------------------------------- the noise
def _aqn(**kw):
    return qnoise.AQNConfig(**{**dict(enabled=True, sigma_start=1e-2, sigma_end=1e-3, num_stages=4, seed=3,
                                      mode="upstream"), **kw})


def _bf16_fold(clean, draws):
    """clean, rounded to bf16, then each draw added with one bf16 rounding per step (upstream's add_ in bf16)."""
    w = clean.to(torch.bfloat16)
    for z in draws:
        w = (w.float() + z.float()).to(torch.bfloat16)
    return w


def _draws(aqn, total, steps, norms):
    """{name: [the bf16 draw of each noisy step]}: step k's generator, one vector per norm in model order."""
    out = {n: [] for n, _ in norms}
    for s in steps:
        _, sigma = aqn.sigma_at(s, total)
        if sigma == 0:
            continue
        g = torch.Generator().manual_seed(aqn.seed * qnoise.NOISE_SEED_STRIDE + s)
        for n, m in norms:
            out[n].append((sigma * torch.randn(m.weight.shape, generator=g)).to(torch.bfloat16))
    return out


def _frozen(model):
    """A frozen base, as after quantize_ (requires_grad marks the weights training moves, e.g. train_norms)."""
    return model.float().requires_grad_(False)


def test_upstream_noise_accumulates_in_bf16_on_every_norm(tiny_llama):
    model = _frozen(tiny_llama)
    norms = qnoise.find_all_norms(model)
    n_layers = model.config.num_hidden_layers
    assert len(norms) == 2 * n_layers + 1 and norms[-1][0] == "model.norm"  # the final norm included
    clean = {n: m.weight.detach().clone() for n, m in norms}
    aqn, total = _aqn(sigma_end=1e-2), 8  # stages of 2 steps, counted from 1 as upstream does: step 0 is stage 0
    assert [aqn.sigma_at(s, total)[0] for s in range(8)] == [0, 1, 1, 2, 2, 3, 3, 3]
    noise = qnoise.UpstreamNoise(aqn, total)
    seen = []
    for step in range(total):
        with qnoise.upstream_norms(model, noise, step) as n:
            seen.append((n, {k: m.weight.detach().clone() for k, m in norms}))
        for k, m in norms:  # the clean weights are back, bitwise
            assert torch.equal(m.weight, clean[k])
    assert seen[0][0] == 0 and all(n == len(norms) for n, _ in seen[1:])
    draws = _draws(aqn, total, range(total), norms)
    for step in (1, 4, 7):
        for k, _ in norms:
            want = _bf16_fold(clean[k], draws[k][:step])  # every noisy step so far: nothing was removed
            assert torch.equal(seen[step][1][k], want.float()), (step, k)
    # accumulation, seen in the numbers: after 7 noisy steps the weights sit further from clean than after 1
    dev = lambda s: torch.cat([(seen[s][1][k] - clean[k].to(torch.bfloat16).float()).flatten() for k, _ in norms])  # noqa: E731
    assert float(dev(7).std()) > 2 * float(dev(1).std())  # sqrt(7) for a constant sigma


def test_upstream_noise_on_trained_norms_is_one_draw_and_resume_replays(tiny_llama):
    """With --ln True upstream reloads the trained input/post-attention norms into vLLM before each step's
    noise (grpo_trainer.py lines 1319-1329): those carry one draw on the current weight; the final norm,
    never reloaded, accumulates. A fresh UpstreamNoise at step t (a resumed run) gives the same weights."""
    model = _frozen(tiny_llama)
    norms = qnoise.find_all_norms(model)
    for n, m in norms:
        m.weight.requires_grad_(n != "model.norm")
    aqn, total = _aqn(), 8
    noise = qnoise.UpstreamNoise(aqn, total)
    for step in range(5):
        with torch.no_grad():  # training moves the trained norms between rollouts
            for _, m in norms:
                if m.weight.requires_grad:
                    m.weight.add_(0.01)
        rollout = noise.weights(model, step)
    draws = _draws(aqn, total, range(5), norms)
    for n, m in norms:
        if n == "model.norm":
            assert torch.equal(rollout[n], _bf16_fold(m.weight.detach(), draws[n]))
        else:
            assert torch.equal(rollout[n], _bf16_fold(m.weight.detach(), draws[n][-1:]))
    resumed = qnoise.UpstreamNoise(aqn, total).weights(model, 4)
    assert rollout.keys() == resumed.keys() and all(torch.equal(rollout[k], resumed[k]) for k in rollout)


def test_rollout_noise_dispatches_by_mode(tiny_llama):
    model = _frozen(tiny_llama)
    restored = _aqn(mode="restored")
    _, sigma = restored.sigma_at(5, 8)
    with qnoise.rollout_noise(model, restored, 5, 8, sigma) as n:
        a = [m.weight.detach().clone() for _, m in qnoise.find_norms(model)]
    with qnoise.noisy_norms(model, sigma, seed=restored.seed * qnoise.NOISE_SEED_STRIDE + 5) as n2:
        b = [m.weight.detach().clone() for _, m in qnoise.find_norms(model)]
    assert n == n2 == 2 * model.config.num_hidden_layers and all(torch.equal(x, y) for x, y in zip(a, b))
    with qnoise.rollout_noise(model, _aqn(), 5, 8, sigma) as n:
        assert n == 2 * model.config.num_hidden_layers + 1
    assert isinstance(model.qerl_upstream_noise, qnoise.UpstreamNoise)
    with qnoise.rollout_noise(model, _aqn(enabled=False), 5, 8, 0.0) as n:
        assert n == 0
    with pytest.raises(ValueError, match="aqn_mode"):
        make_config("smoke", aqn_mode="accumulate")


def test_upstream_profile_trains_one_epoch_on_a_tiny_model(tmp_path, tiny_llama_dir):
    """One epoch of 4 prompts at 1 prompt x 2 completions = 4 steps; the noisy steps perturb every norm."""
    from qerl.train import epoch_steps, train

    assert epoch_steps(7473, 1, 1.0) == 7473 and epoch_steps(10, 4, 1.0) == 2
    with pytest.raises(ValueError, match="no step"):
        epoch_steps(3, 4, 1.0)
    rows = [{"question": f"w{i} w{i + 1}", "answer": str(i)} for i in range(4)]
    cfg = make_config("upstream", model=str(tiny_llama_dir), optim="adamw", eval_datasets=(), num_stages=2,
                      max_completion_length=4, max_prompt_length=512, gradient_checkpointing=False,
                      wandb_mode="disabled", save_every=0, output_dir=str(tmp_path / "run"))
    assert train(cfg, train_dataset=rows)["status"] == "ok"
    out = tmp_path / "run"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["max_steps"] == 4 and recorded["num_train_epochs"] == 1.0 and recorded["aqn_mode"] == "upstream"
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert [r["aqn/num_modules"] for r in metrics] == [0, 5, 5, 5]  # tiny llama: 2 layers x 2 norms + final norm
