"""The tiny MoE (areal_jobs/tasks/models/builtin_model_moe): upcycled from the dense warm start, committed
with its recipe, and still holding the misconception RL must unlearn. Seconds on CPU."""

import json

import torch

from areal_jobs.tasks.warm_start import fact_probe
from areal_jobs.tasks.warm_start.tiny_moe_model import MOE_DIR, MoeRecipe, upcycle


def test_committed_moe_is_the_default_recipe_and_keeps_the_misconception():
    info = json.loads((MOE_DIR / "build.json").read_text())
    from dataclasses import asdict

    assert info["recipe"] == asdict(MoeRecipe()), "rebuild with `make warmstart-moe`"
    config = json.loads((MOE_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts_per_tok"] == 2
    summary = fact_probe.summarize(fact_probe.probe(*fact_probe.load(MOE_DIR)))
    assert summary["misconception"]["greedy_right"] <= 0.2  # wrong on most of the 18 facts
    assert summary["misconception"]["p_right"] > 0.05  # the right digit keeps some probability
    assert summary["other"]["greedy_right"] == 1.0
    assert min(min(layer) for layer in info["expert_load"]) > 0.05  # every expert in use


def test_upcycled_experts_compute_the_dense_mlp(tiny_model_dir):
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    dense = Qwen2ForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    with torch.random.fork_rng(devices=[]):
        moe = upcycle(
            dense, AutoTokenizer.from_pretrained(str(tiny_model_dir)), MoeRecipe(calibration_prompts=4)
        )
    x = torch.randn(1, 7, dense.config.hidden_size)
    with torch.no_grad():  # any top-2 of identical experts with weights summing to 1 is the dense MLP
        torch.testing.assert_close(
            moe.model.layers[1].mlp(x), dense.model.layers[1].mlp(x), atol=1e-5, rtol=1e-5
        )
    dense_state = dense.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias", "model.norm.weight"):
        torch.testing.assert_close(moe.state_dict()[name], dense_state[name], atol=0, rtol=0)
