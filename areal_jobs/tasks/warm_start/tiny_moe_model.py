"""The built-in mixture-of-experts policy: the arithmetic task's tokenizer and a tiny Qwen3-MoE.

Qwen3MoeForCausalLM at toy width: every layer's MLP is `num_experts` SwiGLU experts of which a
softmax router picks `num_experts_per_tok` per token (Qwen3-30B-A3B's block). It starts from the
dense built-in model's warm start (tasks/models/builtin_model: the task, its tokenizer, and the
misconception RL has to unlearn) by sparse upcycling (Komatsuzaki et al. 2022, as Qwen1.5-MoE was
made from Qwen-1.8B): embeddings and attention copied, every expert a copy of the dense MLP, the
router random. Qwen3 attention normalises q and k per head (q_norm, k_norm) where Qwen2 does not:
their gains are set to the dense model's mean per-head RMS of q and k on task text, which keeps
the attention logits' scale. A short continued warm start on the dense model's last phase (careless
answers with the misconception, tiny_model.sft_loop) with the router's load-balancing loss then
adapts the attention to the norms and separates the experts (identical experts give the router no
gradient but that loss's). Why not the dense recipe from scratch: its 2,900 steps cost hours of the
shared CPUs; the upcycled model starts where the dense one does, which is also the comparison RL
wants (same policy, a dense or a sparse MLP). Committed in areal_jobs/tasks/models/builtin_model_moe/;
`make warmstart-moe` rebuilds it, `make run EXP=local_moe` trains it:

    python -m areal_jobs.tasks.warm_start.tiny_moe_model --out areal_jobs/tasks/models/builtin_model_moe
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from areal_jobs.tasks import arith_task
from areal_jobs.tasks.warm_start.tiny_model import (
    PACKAGED_DIR,
    SFT_SEED,
    answer_examples,
    heldout_accuracy,
    sft_loop,
    warmup_cosine,
)

logger = logging.getLogger(__name__)

MOE_DIR = Path(__file__).resolve().parents[1] / "models" / "builtin_model_moe"


@dataclass(frozen=True)
class MoeRecipe:
    """Everything that determines the built model (with the dense base's build.json); in build.json."""

    num_experts: int = 4
    num_experts_per_tok: int = 2
    # Qwen3-30B-A3B ships 0.001; at toy scale and a short warm start a larger weight separates the
    # experts' loads sooner. The saved config carries it: the trainer's default weight
    router_aux_loss_coef: float = 0.01
    router_init_std: float = 0.02
    calibration_prompts: int = 64  # task texts that set the q/k norm gains
    steps: int = 60  # continued warm start: the dense model's phase 3 (careless + misconception)
    lr: float = 1e-3  # the dense phase 3's; warm-up, then cosine to 0
    tokens_per_step: int = 512
    heldout_prompts: int = 64
    seed: int = 0
    recipe_version: int = 1


def moe_config(dense_config, recipe: MoeRecipe):
    """The Qwen3-MoE of the dense Qwen2's shape: every layer sparse, every expert the dense MLP's width."""
    from transformers import Qwen3MoeConfig

    d = dense_config
    return Qwen3MoeConfig(
        vocab_size=d.vocab_size,
        hidden_size=d.hidden_size,
        intermediate_size=d.intermediate_size,  # unused: every layer is sparse
        moe_intermediate_size=d.intermediate_size,
        num_experts=recipe.num_experts,
        num_experts_per_tok=recipe.num_experts_per_tok,
        norm_topk_prob=True,  # top-k weights sum to 1: k copies of one MLP give that MLP
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=recipe.router_aux_loss_coef,
        output_router_logits=False,
        num_hidden_layers=d.num_hidden_layers,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.hidden_size // d.num_attention_heads,
        attention_bias=True,  # Qwen2's q/k/v biases (o_proj's is set to 0)
        max_position_embeddings=d.max_position_embeddings,
        rms_norm_eps=d.rms_norm_eps,
        tie_word_embeddings=True,
        rope_theta=d.rope_parameters["rope_theta"],
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        torch_dtype="float32",
    )


def _head_rms(dense, tokenizer, recipe: MoeRecipe) -> list[tuple[float, float]]:
    """Per layer, the mean RMS of a q head and of a k head (after bias, before RoPE) on task texts."""
    import torch

    sums = [[0.0, 0.0] for _ in dense.model.layers]
    count = 0

    def hook(layer: int, slot: int, head_dim: int):
        def record(_module, _inputs, out):
            sums[layer][slot] += float(out.reshape(-1, head_dim).pow(2).mean(-1).sqrt().mean())

        return record

    head_dim = dense.config.hidden_size // dense.config.num_attention_heads
    handles = []
    for i, layer in enumerate(dense.model.layers):
        handles.append(layer.self_attn.q_proj.register_forward_hook(hook(i, 0, head_dim)))
        handles.append(layer.self_attn.k_proj.register_forward_hook(hook(i, 1, head_dim)))
    for i in range(recipe.calibration_prompts):
        p = arith_task.problem_at(SFT_SEED + 3, i)
        with torch.no_grad():
            dense(input_ids=torch.tensor([tokenizer.encode(p.prompt + p.solution)]), use_cache=False)
        count += 1
    for h in handles:
        h.remove()
    return [(q / count, k / count) for q, k in sums]


def upcycle(dense, tokenizer, recipe: MoeRecipe):
    """A Qwen3MoeForCausalLM computing (up to the q/k norms) what `dense` (Qwen2) computes."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    moe = Qwen3MoeForCausalLM(moe_config(dense.config, recipe))
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    missing, unexpected = moe.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    rms = _head_rms(dense, tokenizer, recipe)
    with torch.no_grad():
        for i, (d_layer, m_layer) in enumerate(zip(dense.model.layers, moe.model.layers, strict=True)):
            attn = m_layer.self_attn
            attn.o_proj.bias.zero_()
            attn.q_norm.weight.fill_(rms[i][0])
            attn.k_norm.weight.fill_(rms[i][1])
            mlp, experts = d_layer.mlp, m_layer.mlp.experts
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)
            experts.gate_up_proj.copy_(gate_up.unsqueeze(0).expand_as(experts.gate_up_proj))
            experts.down_proj.copy_(mlp.down_proj.weight.unsqueeze(0).expand_as(experts.down_proj))
            m_layer.mlp.gate.weight.normal_(0.0, recipe.router_init_std)
    left = [k for k in missing if not any(s in k for s in (".mlp.", "q_norm", "k_norm", "o_proj.bias"))]
    assert not left, f"not carried over from the dense model: {left}"
    return moe


def expert_load(model, tokenizer, num_prompts: int = 64, seed: int = 1) -> list[list[float]]:
    """Share of top-k assignments each expert receives, per layer, over held-out prompts + worked
    answers: how evenly the warm start uses its experts (1/num_experts each when balanced)."""
    import torch

    from areal_jobs.tasks import arith_task

    counts = torch.zeros(model.config.num_hidden_layers, model.config.num_experts)
    for i in range(num_prompts):
        p = arith_task.eval_problem_at(seed, i)
        ids = tokenizer.encode(p.prompt + p.solution, add_special_tokens=False)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_router_logits=True, use_cache=False)
        for layer, logits in enumerate(out.router_logits):
            top = logits.topk(model.config.num_experts_per_tok, dim=-1).indices.reshape(-1)
            counts[layer] += torch.bincount(top, minlength=model.config.num_experts).float()
    return (counts / counts.sum(dim=1, keepdim=True)).round(decimals=3).tolist()


def build_moe_model(
    out_dir: Path, recipe: MoeRecipe, dense_dir: Path = PACKAGED_DIR, threads: int = 2
) -> dict:
    """Upcycle `dense_dir`'s warm start, continue it, save an HF directory in `out_dir`; returns build.json's content."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from areal_jobs.tasks.warm_start import fact_probe

    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(dense_dir))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the task's tokenizer, byte for byte
        shutil.copyfile(dense_dir / name, out_dir / name)
    dense = Qwen2ForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32).eval()
    model = upcycle(dense, tokenizer, recipe)
    dense_info = json.loads((dense_dir / "build.json").read_text())
    info: dict = {
        "recipe": asdict(recipe),
        "dense_base": {k: dense_info[k] for k in ("recipe", "heldout", "facts")},
    }
    # tiny_model.sft_loop adds the load-balancing loss the forward returns when asked for router logits
    model.config.output_router_logits = True
    base = json.loads((dense_dir / "build.json").read_text())["recipe"]
    mistakes = random.Random(recipe.seed + 2)

    def answer(problem: arith_task.ArithProblem, step: int) -> str:
        return arith_task.worked_solution(
            problem.start,
            problem.ops,
            base["sft_slip_rate"],
            mistakes,
            misconception_rate=base["misconception_rate"],
        )[0]

    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    info["sft_final_loss"] = sft_loop(
        model, opt, recipe.tokens_per_step, recipe.steps, warmup_cosine(recipe.lr, recipe.steps),
        answer_examples(tokenizer, answer), SFT_SEED + 5, "MoE warm start (upcycled)",
    )  # fmt: skip
    model.config.output_router_logits = False  # servers and generate need no router logits
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    info["parameters"] = params
    info["active_parameters"] = int(
        params - expert_params * (1 - recipe.num_experts_per_tok / recipe.num_experts)
    )
    # 64 of the dense build's 256 held-out prompts: the shared CPUs' minutes (a run's own start-of-run
    # evaluation scores all of data.num_eval_prompts through the server)
    info["heldout"] = heldout_accuracy(model, tokenizer, num_prompts=recipe.heldout_prompts)
    info["facts"] = fact_probe.summarize(fact_probe.probe(model, tokenizer))
    info["expert_load"] = expert_load(model, tokenizer)
    info["build_s"] = time.time() - t0
    (out_dir / "build.json").write_text(json.dumps(info, indent=2))
    logger.info(
        "MoE model built in %.0fs (SFT loss %.3f) -> %s", info["build_s"], info["sft_final_loss"], out_dir
    )
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build the built-in tiny MoE model (tokenizer + warm start)."
    )
    parser.add_argument("--out", type=Path, default=MOE_DIR, help="HF directory to write")
    parser.add_argument("--dense", type=Path, default=PACKAGED_DIR, help="the dense warm start to upcycle")
    parser.add_argument("--steps", type=int, default=MoeRecipe.steps, help="continued warm-start steps")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    build_moe_model(args.out, MoeRecipe(steps=args.steps), dense_dir=args.dense, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
