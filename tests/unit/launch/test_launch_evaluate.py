"""`launch.evaluate` without a server: argument parsing and validation, the JSON/PNG it writes from
known answers, and which HF directory a checkpoint argument resolves to (a mid-run torch
checkpoint is converted with its own weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_jobs.config import JobConfig, save_job_config
from areal_jobs.data.eval_sets import EvalSet
from areal_jobs.rollout.evaluation import EvalOutcome, EvalSummary, ProblemResult
from launch.evaluation.checkpoint import resolve_hf_dir
from launch.evaluation.evaluate import max_prompt_tokens, parse_args
from launch.evaluation.report import build_report, summary_line, write_report

REPO = Path(__file__).resolve().parents[3]
BUILTIN = REPO / "areal_jobs" / "tasks" / "models" / "builtin_model"
GSM8K = REPO / "tests" / "fixtures" / "gsm8k" / "test_head50.jsonl"


def test_defaults_evaluate_the_builtin_model_on_the_builtin_task_with_pass_at_1_and_n():
    args = parse_args([])
    assert args.kind is EvalSet.builtin and args.samples == 8 and args.ks == [1, 8] and args.greedy
    assert args.out == "runs/eval/models-builtin_model-builtin"


def test_countdown_set_defaults_to_the_countdown_warm_start():
    args = parse_args(["--data", "countdown"])
    assert args.kind is EvalSet.countdown and args.ckpt == "areal_jobs/tasks/models/builtin_model_countdown"
    assert args.spec().path == "" and parse_args(["--data", "countdown", "--ckpt", "x"]).ckpt == "x"


def test_file_layout_is_detected_and_fields_and_ks_are_taken(tmp_path):
    args = parse_args(["--data", str(GSM8K), "-n", "4", "-k", "2", "-k", "4", "--limit", "10", "--no-greedy"])
    assert args.kind is EvalSet.gsm8k and args.ks == [2, 4] and args.limit == 10 and not args.greedy
    aime = tmp_path / "aime.jsonl"
    aime.write_text(json.dumps({"Problem": "p", "Answer": 3}) + "\n")
    args = parse_args(["--data", str(aime), "--problem-field", "Problem", "--answer-field", "Answer"])
    spec = args.spec()
    assert spec.kind is EvalSet.math and (spec.problem_field, spec.answer_field) == ("Problem", "Answer")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["-n", "4", "-k", "5"], "--k must be in 1..--samples"),
        (["-n", "0"], "--samples"),
        (["--temperature", "0"], "--temperature"),
        (["--data", str(GSM8K), "--format", "builtin"], "--format builtin"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(argv, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_args(argv)


def test_prompts_leave_room_for_the_answer_in_the_context():
    assert max_prompt_tokens(BUILTIN, 256) == 512 - 256  # builtin: max_position_embeddings 512
    with pytest.raises(ValueError, match="no room"):
        max_prompt_tokens(BUILTIN, 512)


def outcome(rows, n):
    problems = [ProblemResult(i, f"ref{i}", [f"t{i}"] * n, r, [10] * n, [False] * (n - 1) + [True])
                for i, r in enumerate(rows)]  # fmt: skip
    summary = EvalSummary(0.0, 0.0, len(rows), 0, 0, samples_per_problem=n)
    return EvalOutcome(summary, problems)


def test_report_json_png_and_line_from_known_answers(tmp_path):
    # 2 problems x 4 samples: 1 and 0 correct. pass@1 = (1/4 + 0)/2; pass@2 = (1 - C(3,2)/C(4,2))/2
    sampled = outcome([[1.0, 0.0, 0.0, 0.0], [0.0] * 4], 4)
    sampled = EvalOutcome(
        EvalSummary(0.125, 0.125, 2, 0, 0, 4, {1: 0.125, 4: 0.5}, 10.0, 0.25), sampled.problems
    )
    greedy = EvalOutcome(EvalSummary(0.5, 0.5, 2, 0, 0), outcome([[1.0], [0.0]], 1).problems)
    meta = {"checkpoint": "final_hf", "data": "builtin", "max_new_tokens": 16}
    report = build_report(sampled, greedy, [1, 4], meta)
    assert report["pass@1"] == 0.125 and report["greedy_accuracy"] == 0.5
    assert report["pass_at_k_curve"]["2"] == pytest.approx((1 - 3 / 6) / 2)
    assert report["pass@k"] == {"1": 0.125, "4": 0.5}
    assert report["problems"][0]["num_correct"] == 1 and report["problems"][0]["greedy_reward"] == 1.0
    line = summary_line(report)
    assert line == (
        "eval: pass@1=0.125 pass@4=0.500 greedy=0.500 mean_length=10.0 truncation_rate=0.250 problems=2 samples=4"
    )
    json_path, png_path = write_report(tmp_path / "out", report)
    assert json.loads(json_path.read_text())["pass@k"]["4"] == 0.5
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_hf_dir_is_served_as_is_and_a_non_checkpoint_is_refused(tmp_path):
    assert resolve_hf_dir(str(BUILTIN)) == BUILTIN
    with pytest.raises(ValueError, match="neither an HF directory"):
        resolve_hf_dir(str(tmp_path))
    (tmp_path / "step_000004" / "trainer").mkdir(parents=True)
    with pytest.raises(ValueError, match="Megatron"):
        resolve_hf_dir(str(tmp_path / "step_000004"))


def test_a_mid_run_torch_checkpoint_becomes_an_hf_dir_with_its_own_weights(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    cfg = JobConfig()
    cfg.model.builtin_dir = str(BUILTIN)
    save_job_config(cfg, run_dir / "config.yaml")
    step = run_dir / "checkpoints" / "step_000040"
    (step / "trainer").mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(str(BUILTIN), dtype=torch.float32)
    state = model.state_dict()
    key = "model.norm.weight"
    state[key] = torch.full_like(state[key], 0.5)  # a trained weight that the base model lacks
    torch.save({"model": state, "optimizer": {}}, step / "trainer" / "trainer.pt")
    (run_dir / "checkpoints" / "latest").write_text("step_000040")

    hf = resolve_hf_dir(str(run_dir / "checkpoints" / "latest"))
    assert hf == step / "hf" and (hf / "tokenizer.json").exists()
    weights = load_file(str(hf / "model.safetensors"))
    assert torch.equal(weights[key], torch.full_like(weights[key], 0.5))
    assert resolve_hf_dir(str(step)) == hf  # converted once
