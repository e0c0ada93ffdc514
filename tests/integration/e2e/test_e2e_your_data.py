"""A verl user's own task through `python -m launch.local` (what `make run` runs), with no
conversion: the built-in arithmetic task's problems written here as Parquet in verl's exact schema
(`data_source`, `prompt` as chat messages, `ability`, `reward_model.ground_truth`, `extra_info`)
and a reward file with verl's signature `compute_score(data_source, solution_str, ground_truth,
extra_info)`, also written here. The run must learn: held-out accuracy up (summary.json's
accuracy_start -> accuracy_end, what `make run` prints), on the same held-out problems the built-in
run scores. Then a two-source mixture (chains of 1-2 vs 3-20 steps, weights 0.7/0.3) whose
per-source metrics reach metrics.jsonl and TensorBoard and whose final table has a row per source.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_jobs.tasks import arith_task

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
SEED = 1  # data.seed of the built-in run: the same held-out problems (arith_task.eval_problem_at)

REWARD_FILE = '''
import re

_ANSWER = re.compile(r"The answer is (-?\\d+)\\.")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: 1.0 when the stated final answer equals the ground truth; a dict, so its
    other key (`stated`) shows in the metrics that this function, not a built-in verifier, ran."""
    found = _ANSWER.findall(solution_str)
    return {"score": 1.0 if found and found[-1] == str(ground_truth) else 0.0, "stated": float(bool(found))}
'''


def verl_row(problem: arith_task.ArithProblem, split: str, index: int) -> dict:
    """One row exactly as verl's examples/data_preprocess scripts write it."""
    return {
        "data_source": "arith",
        "prompt": [{"role": "user", "content": problem.prompt}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": split, "index": index, "num_steps": problem.num_steps},
    }


def write_parquet(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> dict[str, str]:
    """train/test Parquet in verl's schema, per-length sources for the mixture, the reward file."""
    root = tmp_path_factory.mktemp("user-files")
    train = [arith_task.problem_at(SEED, i) for i in range(4000)]
    test = [arith_task.eval_problem_at(SEED, i) for i in range(256)]
    files = {
        "train": write_parquet(
            root / "train.parquet", [verl_row(p, "train", i) for i, p in enumerate(train)]
        ),
        "test": write_parquet(root / "test.parquet", [verl_row(p, "test", i) for i, p in enumerate(test)]),
    }
    for name, keep in (("short", lambda n: n <= 2), ("long", lambda n: n >= 3)):
        files[f"{name}_train"] = write_parquet(
            root / f"{name}_train.parquet",
            [verl_row(p, "train", i) for i, p in enumerate(train) if keep(p.num_steps)],
        )
        files[f"{name}_test"] = write_parquet(
            root / f"{name}_test.parquet",
            [verl_row(p, "test", i) for i, p in enumerate(test) if keep(p.num_steps)][:32],
        )
    (root / "rewards.py").write_text(REWARD_FILE)
    files["reward"] = f"{root / 'rewards.py'}:compute_score"
    return files


def run(tmp_path: Path, name: str, *overrides: str) -> tuple[Path, str]:
    cmd = [
        sys.executable, "-m", "launch.local", f"run.name={name}", f"run.root={tmp_path}",
        f"data.seed={SEED}", *overrides,
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    run_dir = tmp_path / name
    if result.returncode != 0:
        logs = "\n".join(
            f"== {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run_dir / "logs").glob("*.log"))
        )
        pytest.fail(f"launch.local failed ({result.returncode}):\n{result.stdout[-3000:]}\n{logs}")
    return run_dir, result.stdout


def test_verl_parquet_and_verl_reward_file_learn(tmp_path, user_files):
    run_dir, out = run(
        tmp_path, "verl",
        f"data.train_path={user_files['train']}", f"data.eval_path={user_files['test']}",
        "data.num_eval_prompts=128", "run.eval_every_steps=0", "trainer.total_steps=40",
        "run.tensorboard=false", f"reward.function={user_files['reward']}",
    )  # fmt: skip
    # the first prompt, rendered from verl's chat messages (the built-in tokenizer has no chat
    # template: the user turn as it is), is the built-in task's own first prompt
    assert f"first prompt:\n{arith_task.problem_at(SEED, 0).prompt}\n" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    start, end = summary["accuracy_start"], summary["accuracy_end"]
    print(
        f"verl parquet run: accuracy {start:.3f} -> {end:.3f}, greedy {summary['greedy_accuracy_start']:.3f}"
        f" -> {summary['greedy_accuracy_end']:.3f}, {summary['steps']} steps, {summary['wall_s']} s, "
        "scored by the verl-signature reward file"
    )
    assert summary["steps"] == 40
    # measured (2 shared cores): sampled 0.307 -> 0.398, greedy 0.422 -> 0.500 in 195 s; 128
    # prompts x 4 answers put one evaluation's standard error near 0.03, so +0.02 is a margin that
    # a learning run clears and a flat one (difference sd ~0.04) rarely does
    assert end > start + 0.02, f"no learning: held-out accuracy {start:.3f} -> {end:.3f}"
    # one data_source: its per-source figures are there too
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("source/arith/accuracy" in r for r in rows)
    assert any("eval/arith/accuracy" in r for r in rows)
    # the user's file scored the samples: its extra key is logged as reward/fn/<key>
    assert any("reward/fn/stated" in r for r in rows)


def test_two_source_mixture_reports_each_source(tmp_path, user_files):
    reward = user_files["reward"]
    sources = (
        f"data.sources=[{{name: short, path: '{user_files['short_train']}', eval_path: '{user_files['short_test']}',"
        f" weight: 0.7, num_eval_prompts: 32, reward: '{reward}'}},"
        f" {{name: long, path: '{user_files['long_train']}', eval_path: '{user_files['long_test']}',"
        f" weight: 0.3, num_eval_prompts: 32, reward: '{reward}'}}]"
    )
    run_dir, out = run(
        tmp_path, "mixture", sources, "run.eval_every_steps=6", "trainer.total_steps=12",
        "algo.batch_size=10", "algo.group_size=4", "run.tensorboard=true",
    )  # fmt: skip
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "source/short/samples" in r or "source/long/samples" in r]
    assert len(trained) == 12
    # exact weights over every window of 10 positions: 7 short and 3 long prompts admitted; each
    # batch trains 10 groups, whichever positions finished first, so over the run it is 70/30 to
    # within the groups still in flight at the end (at most a few)
    short = sum(r.get("source/short/samples", 0.0) for r in trained)
    long_ = sum(r.get("source/long/samples", 0.0) for r in trained)
    assert abs(short / (short + long_) - 0.7) < 0.1, (short, long_)
    assert any("reward/fn/stated" in r for r in rows)  # each source's reward: the user's function
    for key in ("reward", "accuracy", "length", "truncated"):
        assert any(f"source/short/{key}" in r for r in trained) and any(
            f"source/long/{key}" in r for r in trained
        )
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(evals) >= 2 and all("eval/short/accuracy" in r and "eval/long/accuracy" in r for r in evals)
    summary = json.loads((run_dir / "summary.json").read_text())
    table = summary["by_source"]
    assert set(table) == {"short", "long"} and {row["num_prompts"] for row in table.values()} == {32}
    for row in table.values():
        assert {"sampled_start", "sampled_end", "greedy_start", "greedy_end", "train_reward"} <= set(row)
    assert "per source" in out and "\nshort " in out and "\nlong " in out
    print(
        "mixture run: "
        + ", ".join(f"{n} {r['sampled_start']:.3f} -> {r['sampled_end']:.3f}" for n, r in table.items())
        + f", {summary['wall_s']} s"
    )
    # TensorBoard holds the same keys (event files are read back with TensorBoard's own reader)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in run_dir.rglob("events.out.tfevents.*")}
    tags = set(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    assert {
        "source/short/accuracy",
        "source/long/reward",
        "eval/short/accuracy",
        "eval/long/accuracy",
    } <= tags
