"""Accuracy per chain length, along its whole path: held-out prompts carry their length bucket,
the evaluation scores per bucket, EvalResult carries it, the trainer's summary tabulates start and
end, and the run prints the table and plots it. Values worked out by hand."""

import json

from areal_jobs.config import DataConfig
from areal_jobs.data.prompts import eval_prompts
from areal_jobs.report import length_table, plot_run
from areal_jobs.rollout.evaluation import bucket_accuracy
from areal_jobs.tasks import arith_task
from areal_jobs.trainer.session import by_length
from areal_jobs.transport import messages as m


def test_held_out_prompts_carry_their_chain_length_bucket():
    prompts = eval_prompts(DataConfig(num_eval_prompts=40), encode=lambda text: [len(text)])
    for i, prompt in enumerate(prompts):
        assert prompt.bucket == arith_task.length_bucket(arith_task.eval_problem_at(1, i).num_steps)
    assert {"1", "2"} <= {p.bucket for p in prompts}


def test_bucket_accuracy_counts_reward_one_per_bucket_and_skips_unbucketed():
    buckets = ["1", "2", "1", "", "3-4", "1"]
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    accuracy, sizes = bucket_accuracy(buckets, rewards)
    assert sizes == {"1": 3, "2": 1, "3-4": 1}
    assert accuracy == {"1": 2 / 3, "2": 0.0, "3-4": 1.0}


def test_summary_table_has_start_and_end_greedy_and_sampled_in_length_order():
    sizes = {"9-20": 2, "1": 5, "3-4": 3}
    evals = [
        m.EvalResult(0, 0.3, 0.3, 10, "start", {"9-20": 0.0, "1": 0.4, "3-4": 0.3}, sizes),
        m.EvalResult(0, 0.5, 0.5, 10, "start_greedy", {"9-20": 0.5, "1": 0.6, "3-4": 0.3}, sizes),
        m.EvalResult(5, 0.9, 0.9, 10, "periodic", {"9-20": 1.0, "1": 1.0, "3-4": 1.0}, sizes),  # not a column
        m.EvalResult(9, 0.7, 0.7, 10, "final", {"9-20": 0.5, "1": 0.8, "3-4": 0.6}, sizes),
        m.EvalResult(9, 0.8, 0.8, 10, "final_greedy", {"9-20": 1.0, "1": 0.8, "3-4": 0.6}, sizes),
    ]
    table = by_length(evals)
    assert list(table) == ["1", "3-4", "9-20"]
    assert table["1"] == {
        "num_prompts": 5, "sampled_start": 0.4, "greedy_start": 0.6, "sampled_end": 0.8, "greedy_end": 0.8,
    }  # fmt: skip
    assert by_length([m.EvalResult(0, 0.3, 0.3, 10, "start")]) == {}
    text = length_table(table).splitlines()
    assert text[0].split() == [
        "steps",
        "prompts",
        "greedy_start",
        "greedy_end",
        "sampled_start",
        "sampled_end",
    ]
    assert text[1].split() == ["1", "5", "0.600", "0.800", "0.400", "0.800"]
    assert text[3].split() == ["9-20", "2", "0.500", "1.000", "0.000", "0.500"]


def test_plot_has_a_length_panel(tmp_path):
    rows = [{"step": 1, "reward/mean": 0.2}, {"step": 1, "eval/accuracy": 0.3, "eval/version": 0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = {"1": {"num_prompts": 3, "greedy_start": 0.3, "greedy_end": 0.9}}
    import matplotlib.image

    wide = matplotlib.image.imread(plot_run(tmp_path, {"by_length": table}))
    narrow = matplotlib.image.imread(plot_run(tmp_path, {}))
    assert wide.shape[1] > 1.5 * narrow.shape[1]  # the second panel is there
