"""Mixtures (data.sources): exact weights over every window, a pure and resumable function of
(seed, position), each prompt with its source's reward; validation naming the override; the
per-source metric keys of training batches, evaluations and the end-of-run table."""

import json
from collections import Counter
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from areal_jobs.config import DataConfig, Dataset, SourceConfig
from areal_jobs.data.mixture import MixtureStream, slot_table, window_counts
from areal_jobs.data.prompts import load_prompts
from areal_jobs.data.source_metrics import eval_source_metrics, source_metrics
from areal_jobs.report import source_table
from areal_jobs.rollout.evaluation import bucket_accuracy


def encode(text):
    return [ord(c) % 250 for c in text]


def rows_file(path, name, n):
    rows = [
        {
            "data_source": name,
            "prompt": [{"role": "user", "content": f"{name} question {i}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def mixture(tmp_path, seed=1, weights=(0.7, 0.3), rewards=("", "math"), window=0):
    sources = [
        SourceConfig(name="easy", path=rows_file(tmp_path / "easy.parquet", "arith", 30), weight=weights[0],
                     reward=rewards[0], num_eval_prompts=4),
        SourceConfig(name="hard", path=rows_file(tmp_path / "hard.parquet", "hard", 20), weight=weights[1],
                     reward=rewards[1], num_eval_prompts=3),
    ]  # fmt: skip
    return DataConfig(sources=sources, seed=seed, chat_template="none", mixture_window=window)


@pytest.mark.parametrize(
    ("weights", "window", "counts"),
    [
        ((0.7, 0.3), 0, [7, 3]),
        ((1, 1, 1), 0, [1, 1, 1]),
        ((0.5, 0.25, 0.25), 0, [2, 1, 1]),
        ((2, 1), 0, [2, 1]),
        ((0.7, 0.3), 20, [14, 6]),
        ((1, 1, 1), 10, [4, 3, 3]),  # not whole: largest remainder, ties to the first source
    ],
)
def test_window_counts_keep_the_weights(weights, window, counts):
    assert window_counts(list(weights), window) == counts
    table = slot_table(counts)
    assert Counter(table) == dict(enumerate(counts))


def test_the_slots_are_spread_not_blocked():
    assert "".join("ab"[s] for s in slot_table([7, 3])) == "abaaabaaba"


def test_exact_weights_over_every_window_and_the_rewards_follow_the_source(tmp_path):
    prompts = load_prompts(mixture(tmp_path), "/nonexistent", encode)
    stream = prompts.stream
    assert isinstance(stream, MixtureStream) and stream.window == 10
    got = [stream.at(i) for i in range(200)]
    for start in range(0, 200, 10):
        window = Counter(p.source for p in got[start : start + 10])
        assert window == {"easy": 7, "hard": 3}
    assert [p.data_index for p in got] == list(range(200))
    by_source = {p.source: p for p in got}
    # "" = the dataset's default: verl's routing by the row's data_source ("arith" is a verifier)
    assert by_source["easy"].reward_task == "arith" and by_source["easy"].data_source == "arith"
    assert by_source["hard"].reward_task == "math" and by_source["hard"].data_source == "hard"
    assert json.loads(by_source["hard"].extra_info)["ability"] == "math"
    # each source's rows are visited once per epoch (26 training rows of easy, 17 of hard)
    easy = [p.reference for p in got if p.source == "easy"][:26]
    assert sorted(easy, key=int) == [str(i) for i in range(26)]


def test_the_stream_is_a_pure_function_of_seed_and_position(tmp_path):
    cfg = mixture(tmp_path)
    first = load_prompts(cfg, "/nonexistent", encode).stream
    run = [first.next() for _ in range(50)]
    resumed = load_prompts(cfg, "/nonexistent", encode).stream
    resumed.position = 20
    assert [resumed.next() for _ in range(30)] == run[20:]
    assert [resumed.at(i) for i in (7, 3, 49)] == [run[7], run[3], run[49]]
    other = load_prompts(mixture(tmp_path, seed=2), "/nonexistent", encode).stream
    assert [other.at(i).reference for i in range(50)] != [p.reference for p in run]
    # the schedule itself does not depend on the seed: the weights hold for every seed
    assert [other.at(i).source for i in range(50)] == [p.source for p in run]


def test_held_out_prompts_of_every_source_with_distinct_indices(tmp_path):
    held_out = load_prompts(mixture(tmp_path), "/nonexistent", encode).held_out
    assert Counter(p.source for p in held_out) == {"easy": 4, "hard": 3}
    indices = [p.data_index for p in held_out]
    assert len(set(indices)) == 7 and max(indices) < 0
    assert bucket_accuracy([p.source for p in held_out], [1.0] * 4 + [0.0] * 3) == (
        {"easy": 1.0, "hard": 0.0},
        {"easy": 4, "hard": 3},
    )


def test_a_builtin_source_mixes_with_a_file(tmp_path):
    cfg = DataConfig(
        sources=[
            SourceConfig(name="arith", dataset=Dataset.arith, weight=1, num_eval_prompts=2),
            SourceConfig(
                name="file", path=rows_file(tmp_path / "f.parquet", "x", 10), weight=1, num_eval_prompts=2
            ),
        ],
        chat_template="none",
    )
    prompts = load_prompts(cfg, "/nonexistent", encode)
    assert [(p.source, p.reward_task) for p in (prompts.stream.at(0), prompts.stream.at(1))] == [
        ("arith", "arith"),
        ("file", "math"),
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight": 0.0}, "data.sources.1.weight=0.0 must be > 0 (drop the source to leave it out)"),
        ({"name": "easy"}, "data.sources.1.name=easy is used twice: source names must be unique"),
        ({"name": ""}, "data.sources.1.name must be a non-empty name without '/' (it keys the metrics)"),
        (
            {"path": ""},
            "data.sources.1.path is empty: set it to the source's rows (or data.sources.1.dataset=arith)",
        ),
    ],
)
def test_validation_names_the_override(tmp_path, change, message):
    good = SourceConfig(name="easy", path="a.parquet")
    bad = SourceConfig(**{"name": "hard", "path": "b.parquet", **change})
    with pytest.raises(ValueError) as err:
        DataConfig(sources=[good, bad])
    assert str(err.value) == message


def test_a_missing_path_and_an_unknown_reward_are_refused_at_load(tmp_path):
    cfg = mixture(tmp_path)
    cfg.sources[1].path = str(tmp_path / "gone.parquet")
    with pytest.raises(FileNotFoundError) as err:
        load_prompts(cfg, "/nonexistent", encode)
    assert str(err.value) == f"data.sources.1.path={tmp_path / 'gone.parquet'}: no such file or directory"
    with pytest.raises(
        ValueError, match=r"data.sources.1.reward=mathh is not a verifier \(arith, code_stdio"
    ):
        load_prompts(mixture(tmp_path, rewards=("", "mathh")), "/nonexistent", encode)
    # a function spec passes through to the reward registry
    spec = load_prompts(mixture(tmp_path, rewards=("", "r.py:compute_score")), "/nonexistent", encode)
    assert {p.reward_task for p in spec.held_out if p.source == "hard"} == {"r.py:compute_score"}


def test_sources_compose_from_yaml_as_a_list_of_dataclasses(tmp_path):
    schema = OmegaConf.structured(DataConfig)
    recipe = OmegaConf.create(
        {
            "sources": [
                {"name": "a", "path": "a.parquet", "weight": 0.7},
                {"name": "b", "path": "b.parquet", "weight": 0.3},
            ]
        }
    )
    cfg = OmegaConf.to_object(OmegaConf.merge(schema, recipe))
    assert [(s.name, s.weight, type(s).__name__) for s in cfg.sources] == [
        ("a", 0.7, "SourceConfig"),
        ("b", 0.3, "SourceConfig"),
    ]


def sample(reward, tokens, finish="stop"):
    return SimpleNamespace(reward=reward, num_tokens=tokens, finish_reason=finish)


def test_per_source_metric_keys():
    groups = [
        SimpleNamespace(source="easy", samples=[sample(1.0, 10), sample(0.0, 20, "length")]),
        SimpleNamespace(source="hard", samples=[sample(0.5, 4), sample(1.0, 6)]),
        SimpleNamespace(source="", samples=[sample(1.0, 1)]),  # no source: no per-source keys
    ]
    assert source_metrics(groups) == {
        "source/easy/reward": 0.5,
        "source/easy/accuracy": 0.5,
        "source/easy/length": 15.0,
        "source/easy/truncated": 0.5,
        "source/easy/samples": 2.0,
        "source/hard/reward": 0.75,
        "source/hard/accuracy": 0.5,
        "source/hard/length": 5.0,
        "source/hard/truncated": 0.0,
        "source/hard/samples": 2.0,
    }
    assert eval_source_metrics({"easy": 0.25, "hard": 0.5}) == {
        "eval/easy/accuracy": 0.25,
        "eval/hard/accuracy": 0.5,
    }


def test_the_end_of_run_table_has_a_row_per_source():
    table = source_table(
        {
            "easy": {"num_prompts": 4, "sampled_start": 0.25, "sampled_end": 0.5, "train_reward": 0.4},
            "hard": {"num_prompts": 3, "greedy_start": 0.0},
        }
    )
    lines = table.splitlines()
    assert lines[0].split() == [
        "source", "prompts", "greedy_start", "greedy_end", "sampled_start", "sampled_end",
        "train_reward", "train_accuracy",
    ]  # fmt: skip
    assert lines[1].split() == ["easy", "4", "-", "-", "0.250", "0.500", "0.400", "-"]
    assert lines[2].split() == ["hard", "3", "0.000", "-", "-", "-", "-", "-"]


def test_the_recipe_and_the_command_line_forms_compose():
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from areal_jobs.config import JobConfig, check_override_keys, register_configs, to_job_config

    conf = Path(__file__).resolve().parents[3] / "conf"
    forms = [
        ["experiment=mixture_local", "data.sources.1.path=/x.parquet", "data.sources.0.weight=0.5"],
        ["data.sources=[{name: a, path: a.parquet, weight: 2}, {name: b, path: b.parquet, weight: 1}]"],
    ]
    register_configs()
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        got = [to_job_config(compose("config", overrides=f)).data.sources for f in forms]
    assert [(s.name, s.path, s.weight) for s in got[0]] == [("arith", "", 0.5), ("mine", "/x.parquet", 0.3)]
    assert [(s.name, s.weight) for s in got[1]] == [("a", 2.0), ("b", 1.0)]
    check_override_keys(forms[0], conf, JobConfig)  # an element's field is a known key
    with pytest.raises(ValueError, match="unknown configuration key: data.sources.1.wieght"):
        check_override_keys(["data.sources.1.wieght=2"], conf, JobConfig)
