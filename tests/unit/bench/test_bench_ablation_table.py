"""bench/ablation_table.py on hand-made run records and metric rows (values worked out by hand)."""

from __future__ import annotations

import pytest

from bench.ablation_table import aggregate, curve_from_rows, markdown, mean_curves, mean_spread, tokens_per_s


def run(eta, objective, seed, greedy, sampled, tps, curve=()):
    return {"eta": eta, "objective": objective, "seed": seed, "greedy_end": greedy,
            "sampled_end": sampled, "tokens_per_s": tps, "curve": [list(p) for p in curve]}  # fmt: skip


def rounded(points):
    return [(v, round(a, 9)) for v, a in points]


RUNS = [
    run(0, "decoupled", 1, 0.60, 0.50, 1000.0, [(0, 0.3, 0.5), (2, 0.5, 0.6)]),
    run(0, "decoupled", 2, 0.70, 0.40, 1200.0, [(0, 0.3, 0.5), (2, 0.3, None)]),
    run(0, "naive", 1, 0.50, 0.20, 900.0, [(0, 0.3, 0.5)]),
    {"eta": 0, "objective": "naive", "seed": 2, "error": "launch.local exit 1"},
    run(4, "decoupled", 1, 0.65, 0.55, 2000.0),
    run(4, "decoupled", 2, 0.75, 0.45, 2400.0),
]


def test_mean_spread_is_mean_and_half_range():
    assert mean_spread([0.59, 0.65, None]) == pytest.approx({"mean": 0.62, "spread": 0.03, "n": 2})
    assert mean_spread([None]) is None


def test_aggregate_cells_skip_failed_runs_and_absent_objectives():
    table = aggregate(RUNS)
    assert list(table) == ["0", "4"]
    dec = table["0"]["decoupled"]
    assert dec["seeds"] == 2
    assert dec["greedy_end"] == pytest.approx({"mean": 0.65, "spread": 0.05, "n": 2})
    assert dec["sampled_end"] == pytest.approx({"mean": 0.45, "spread": 0.05, "n": 2})
    assert dec["tokens_per_s"] == pytest.approx({"mean": 1100.0, "spread": 100.0, "n": 2})
    naive = table["0"]["naive"]  # seed 2 failed: one seed left
    assert naive["seeds"] == 1 and naive["greedy_end"] == pytest.approx({"mean": 0.5, "spread": 0.0, "n": 1})
    assert "naive" not in table["4"]  # never run at η = 4


def test_markdown_is_the_table_2_layout():
    lines = markdown(aggregate(RUNS)).splitlines()
    assert lines[0] == (
        "| η | decoupled greedy | decoupled sampled | decoupled tokens/s "
        "| naive greedy | naive sampled | naive tokens/s |"
    )
    assert lines[2] == "| 0 | 0.650 ± 0.050 | 0.450 ± 0.050 | 1100 ± 100 | 0.500 | 0.200 | 900 |"
    assert lines[3] == "| 4 | 0.700 ± 0.050 | 0.500 ± 0.050 | 2200 ± 200 | - | - | - |"
    assert "(1/2 per cell)" in lines[-1]


def test_mean_curves_average_seeds_per_version():
    curves = mean_curves(RUNS, "decoupled")
    assert set(curves) == {0, 4}
    assert curves[4] == {"sampled": [], "greedy": []}  # runs without evaluations: empty curves
    assert rounded(curves[0]["sampled"]) == [(0, 0.3), (2, 0.4)]
    assert rounded(curves[0]["greedy"]) == [(0, 0.5), (2, 0.6)]  # seed 2 has no greedy at version 2
    assert mean_curves(RUNS, "naive")[0]["sampled"] == [(0, 0.3)]


def test_curve_keys_evaluations_to_the_version_they_measured():
    rows = [
        {"step": 0, "eval/pass@1": 0.3, "eval/version": 0.0},
        {"step": 0, "eval/greedy": 0.5, "eval/greedy_version": 0.0},
        {"step": 1, "time/step_s": 1.0, "train/num_tokens": 10.0},
        {"step": 3, "eval/pass@1": 0.6, "eval/version": 2.0},  # arrived at step 3, measured version 2
        {"step": 3, "eval/greedy": 0.7, "eval/greedy_version": 2.0},
    ]
    assert curve_from_rows(rows) == [[0, 0.3, 0.5], [2, 0.6, 0.7]]


def test_tokens_per_s_leaves_out_warmup_steps():
    rows = [{"step": i + 1, "time/step_s": s, "train/num_tokens": t} for i, (t, s) in
            enumerate([(100.0, 10.0), (100.0, 10.0), (300.0, 1.0), (500.0, 1.0)])]  # fmt: skip
    rows.append({"step": 4, "eval/pass@1": 0.5})
    assert tokens_per_s(rows) == pytest.approx(400.0)  # (300 + 500) / (1 + 1)
    assert tokens_per_s(rows[:2]) == pytest.approx(10.0)  # shorter than the warm-up: every step
    assert tokens_per_s([]) is None
