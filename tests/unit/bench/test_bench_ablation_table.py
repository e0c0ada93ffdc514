"""bench/staleness/ablation_table.py on hand-made run records and metric rows (values worked out by hand)."""

from __future__ import annotations

import math

import pytest

from bench.staleness.ablation_table import (
    ablation_markdown,
    ablation_summary,
    bootstrap_ci,
    calibration_markdown,
    calibration_table,
    mean_sd,
    paired_differences,
    pairs_needed,
    pooled_by_delay,
    pooled_markdown,
    record_from_rows,
    sign_test_p,
    t_interval,
)


def run(arm, seed, sampled, delay=8, lr=1e-3, preclip=0.2, **extra):
    return {"arm": arm, "lr": lr, "minibatches": 4, "delay": delay, "seed": seed, "sampled_end": sampled,
            "greedy_end": sampled + 0.1, "sampled_start": 0.3, "greedy_start": 0.35, "reward_auc": sampled / 2,
            "preclip": preclip, "preclip_cut": preclip / 2, "abs_log_w_p99": 1.0, "ess": 0.9,
            "clip_fraction": 0.05, "k3_kl": preclip / 4, **extra}  # fmt: skip


RUNS = [
    run("naive", 1, 0.40), run("decoupled", 1, 0.50),
    run("naive", 2, 0.45), run("decoupled", 2, 0.50),
    run("naive", 3, 0.50), run("decoupled", 3, 0.45),
    run("decoupled", 4, 0.01),  # collapsed; its naive pair failed: left out of the differences
    {"arm": "naive", "lr": 1e-3, "minibatches": 4, "delay": 8, "seed": 4, "error": "launch.local exit 1"},
    run("naive", 1, 0.42, delay=0, preclip=0.01), run("decoupled", 1, 0.44, delay=0, preclip=0.01),
]  # fmt: skip


def test_mean_sd_uses_the_sample_standard_deviation():
    assert mean_sd([1.0, 3.0, None]) == pytest.approx({"mean": 2.0, "sd": math.sqrt(2.0), "n": 2})
    assert mean_sd([5.0]) == {"mean": 5.0, "sd": 0.0, "n": 1}
    assert mean_sd([None, float("nan")]) is None


def test_paired_differences_pair_by_seed_and_skip_unpaired_seeds():
    d = paired_differences(RUNS, "decoupled", "sampled_end")[(1e-3, 4, 8, 0)]
    assert d["seeds"] == [1, 2, 3]
    assert d["diffs"] == pytest.approx([0.10, 0.05, -0.05])
    assert d["mean"] == pytest.approx(0.10 / 3) and d["sd"] == pytest.approx(
        math.sqrt(0.035 / 6)
    )  # squares 0.0667² + 0.0167² + 0.0833², / 2
    lo, hi = d["ci95"]
    assert -0.05 <= lo <= d["mean"] <= hi <= 0.10  # a percentile interval of means of these values
    # t interval: mean ± t(0.975, df 2) sd / √3 = 0.0333 ± 4.303 x 0.0764 / 1.732 = ± 0.1898
    assert d["t95"] == pytest.approx((0.10 / 3 - 0.18980, 0.10 / 3 + 0.18980), abs=1e-4)
    assert d["t95"][0] < lo and d["t95"][1] > hi  # wider than the bootstrap's at 3 pairs


def test_t_interval_takes_the_next_smaller_listed_df():
    assert t_interval([0.5]) is None
    xs = [0.1 * (i % 3) for i in range(12)]  # df 11: t of df 10 (2.228)
    stat = mean_sd(xs)
    half = 2.228 * stat["sd"] / math.sqrt(12)
    assert t_interval(xs) == pytest.approx((stat["mean"] - half, stat["mean"] + half))


def test_bootstrap_interval_is_reproducible_and_degenerate_for_equal_values():
    xs = [0.1, 0.2, 0.0, 0.15, 0.05]
    assert bootstrap_ci(xs) == bootstrap_ci(xs)
    assert bootstrap_ci([0.1, 0.1, 0.1]) == pytest.approx((0.1, 0.1))
    assert bootstrap_ci([0.1]) is None


def test_pairs_needed_follows_the_power_formula():
    assert pairs_needed(0.05, 0.05) == 8  # 7.85 rounded up
    assert pairs_needed(0.10, 0.05) == 32  # 7.85 x 4 = 31.4
    assert pairs_needed(0.001, 0.05) == 2
    with pytest.raises(ValueError):
        pairs_needed(0.1, 0.0)


def test_calibration_table_by_lr_and_delay():
    table = calibration_table(RUNS)
    row = table["0.001/4"]
    assert set(row["delays"]) == {"0", "8"}
    assert row["delays"]["8"]["preclip"]["mean"] == pytest.approx(0.2) and row["delays"]["8"]["runs"] == 7
    assert row["delays"]["0"]["sampled_gain"]["mean"] == pytest.approx((0.12 + 0.14) / 2)
    lines = calibration_markdown(table).splitlines()
    assert lines[0].startswith("| lr | minibatches | pre-clipped (cut) d=0 | pre-clipped (cut) d=8 |")
    assert lines[2].startswith(
        "| 0.001 | 4 | 0.010 ± 0.000 (0.005 ± 0.000) | 0.200 ± 0.000 (0.100 ± 0.000) |"
    )


def test_ablation_summary_and_markdown():
    cells = ablation_summary(RUNS)
    assert list(cells) == ["0.001/4/0", "0.001/4/8"]
    c = cells["0.001/4/8"]
    assert c["arms"]["decoupled"]["seeds"] == [1, 2, 3, 4] and c["arms"]["naive"]["seeds"] == [1, 2, 3]
    assert c["paired"]["decoupled-naive"]["sampled_end"]["mean"] == pytest.approx(0.10 / 3)
    assert c["paired"]["decoupled_nocap-naive"]["sampled_end"] is None  # that arm did not run
    lines = ablation_markdown(cells).splitlines()
    # one row per cell and arm (that ran there) against naive
    assert lines[2].startswith(
        "| 0.001 | 4 | 0 | fixed | 0.010 ± 0.000 (0.005 ± 0.000) | decoupled | 0.440 | 0.420 | +0.020 ["
    )
    assert lines[3].startswith(
        "| 0.001 | 4 | 8 | fixed | 0.200 ± 0.000 (0.100 ± 0.000) | decoupled | 0.365 ± 0.238 | 0.450 ± 0.050 | +0.033 ["
    )
    assert lines[3].endswith("| 3 | 1/4 / 0/3 |")
    assert c["arms"]["decoupled"]["collapsed"] == 1 and c["arms"]["naive"]["collapsed"] == 0
    # the per-arm mechanism table, after the main one: one row per cell and arm
    mech = lines[lines.index("| lr | mb | delay | arm | runs | collapsed | pre-clipped | cut by naive's clip | "
                             "k3 KL(behav, pre-step) | \\|log w\\| p99 | ESS | clip fraction |"):]  # fmt: skip
    assert mech[2:] == [
        "| 0.001 | 4 | 0 | naive | 1 | 0 | 0.010 | 0.005 | 0.003 | 1.00 | 0.900 | 0.050 |",
        "| 0.001 | 4 | 0 | decoupled | 1 | 0 | 0.010 | 0.005 | 0.003 | 1.00 | 0.900 | 0.050 |",
        "| 0.001 | 4 | 8 | naive | 3 | 0 | 0.200 ± 0.000 | 0.100 ± 0.000 | 0.050 ± 0.000 | 1.00 ± 0.00 | 0.900 ± 0.000 | 0.050 ± 0.000 |",
        "| 0.001 | 4 | 8 | decoupled | 4 | 1 | 0.200 ± 0.000 | 0.100 ± 0.000 | 0.050 ± 0.000 | 1.00 ± 0.00 | 0.900 ± 0.000 | 0.050 ± 0.000 |",
    ]


def test_record_from_rows_leaves_out_the_ramp():
    rows = [{"step": s, "train/version": float(s), "reward/mean": r, "offpolicy/preclip_fraction": p,
             "staleness/min": min(s - 1, 2), "staleness/max": min(s - 1, 2)}
            for s, r, p in [(1, 0.1, 0.0), (2, 0.2, 0.0), (3, 0.3, 0.1), (4, 0.4, 0.3)]]  # fmt: skip
    rows.append({"step": 4, "eval/pass@1": 0.5})
    rec = record_from_rows(rows, delay=2)
    assert rec["reward_auc"] == pytest.approx(0.25)  # every step
    assert rec["preclip"] == pytest.approx(0.2)  # steps 3 and 4: trained at the full delay
    assert rec["steps_at_delay"] == 2.0 and rec["ess"] is None


def test_sign_test_p_by_hand():
    assert sign_test_p([-0.1] * 11) == pytest.approx(2 / 2**11)  # all 11 one way: 2 x (1/2)^11
    assert sign_test_p([-0.1, -0.2, 0.3]) == 1.0  # 2 x P(X <= 1 of 3) = 2 x 4/8, capped at 1
    assert sign_test_p([-0.1, -0.2, -0.3, -0.4, 0.1]) == pytest.approx(2 * 6 / 32)  # P(X <= 1 of 5)
    assert sign_test_p([0.0, 0.0]) is None  # ties only


def test_pooled_by_delay_concatenates_the_pairs_of_every_lr():
    other_lr = [run("naive", 1, 0.40, lr=5e-4), run("decoupled", 1, 0.20, lr=5e-4)]
    pooled = pooled_by_delay(ablation_summary(RUNS + other_lr))
    assert list(pooled) == [0, 8]
    assert (
        pooled[0]["sampled_end"]["n"] == 1 and pooled[0]["sampled_end"]["t95"] is None
    )  # one pair: no interval
    s = pooled[8]["sampled_end"]
    assert pooled[8]["lrs"] == [5e-4, 1e-3]
    assert s["n"] == 4 and s["mean"] == pytest.approx((0.10 + 0.05 - 0.05 - 0.20) / 4)
    assert s["negative"] == 2 and s["sign_p"] == 1.0
    assert pooled[8]["reward_auc"]["mean"] == pytest.approx(-0.10 / 8)  # reward_auc = sampled / 2
    text = pooled_markdown(pooled).splitlines()
    assert text[3].startswith("| decoupled | 8 | 0.0005, 0.001 | 4 | -0.025 [")
    assert "| 2/4 (1) |" in text[3]
    assert pooled_markdown({}) == "(no seed pairs yet)"


def test_new_arms_and_prompt_orders_get_rows_of_their_own():
    """issue 42: an arm beside naive on runs whose prompt order followed the seed (data_seed set)
    forms its own cell ("/ds"), paired only with the naive runs of that order; every arm gets a
    row of the table and of the pooled table."""
    ds = [run("naive", 1, 0.40, data_seed=1), run("m2po", 1, 0.46, data_seed=1),
          run("naive", 2, 0.30, data_seed=2), run("m2po", 2, 0.34, data_seed=2),
          run("cispo", 1, 0.20, data_seed=1)]  # fmt: skip
    cells = ablation_summary(RUNS + ds)
    assert list(cells) == ["0.001/4/0", "0.001/4/8", "0.001/4/8/ds"]
    c = cells["0.001/4/8/ds"]
    assert c["data_follows_seed"] is True and c["arms"]["naive"]["seeds"] == [1, 2]
    assert c["paired"]["m2po-naive"]["sampled_end"]["diffs"] == pytest.approx([0.06, 0.04])
    assert c["paired"]["cispo-naive"]["sampled_end"]["diffs"] == pytest.approx([-0.20])
    assert c["paired"]["decoupled-naive"]["sampled_end"] is None  # the fixed-order runs do not pair here
    lines = ablation_markdown(cells).splitlines()
    rows = [line for line in lines if line.startswith("| 0.001 | 4 | 8 | seed |")]
    assert [r.split(" | ")[5] for r in rows] == ["m2po", "cispo"]
    assert "| m2po | 8 | 0.001 | 2 | +0.050 [" in "\n".join(lines)
