"""Online re-planning (launch/planning/replanning/replan.py): measured numbers into the simulator profile by hand-worked
values, the recommendation against the planner it runs, and the growing-answers comparison."""

from __future__ import annotations

import math

import pytest
from test_launch_simulate import SMALL  # the small 8-node profile the simulator tests use

from launch.planning.layout.allocation import choose_rollout_fraction
from launch.planning.replanning.replan import (
    Measurement,
    decode_model,
    fit_lengths,
    grown_profile,
    growth_comparison,
    measured_profile,
    recommend,
)
from launch.planning.sim.engine import run_async
from launch.planning.sim.profile import LengthModel, load_profile


def test_fit_lengths_by_hand():
    base = LengthModel(min_tokens=16, max_tokens=32768)
    # two prompts, answers alike inside each: median exp(mean(ln 100, ln 10^4)) = 1000, the spread
    # is all between prompts: ln 100 and ln 10^4 lie ln 10 either side of their mean
    fit = fit_lengths(((100, 100), (10_000, 10_000)), base)
    assert fit.median_tokens == pytest.approx(1000)
    assert fit.sample_sigma == 0.0
    assert fit.prompt_sigma == pytest.approx(math.log(10))
    # one prompt: all of the spread is inside it, ln 10 either side of the mean (variance with n - 1:
    # 2 (ln 10)^2 / 1)
    fit = fit_lengths(((100, 10_000),), base)
    assert fit.median_tokens == pytest.approx(1000)
    assert fit.sample_sigma == pytest.approx(math.sqrt(2) * math.log(10))
    assert fit.prompt_sigma == 0.0
    assert (fit.min_tokens, fit.max_tokens) == (16, 32768)


def test_measured_profile_by_hand():
    base = load_profile("paper_1p5b")  # decode 2614 tok/s per GPU at batch 8
    m = Measurement(
        rollout_fraction=0.5,
        gen_tokens_per_s_per_gpu=1307.0,
        gen_batch_per_gpu=8.0,
        train_tokens_per_s_per_gpu=4000.0,
        answer_lengths=((1000, 1000),),
    )
    p = measured_profile(base, m)
    assert p.rollout.tokens_per_s == pytest.approx([v / 2 for v in base.rollout.tokens_per_s])
    assert p.trainer.tokens_per_s_per_gpu == 4000.0
    assert p.lengths.median_tokens == pytest.approx(1000)
    assert p.cluster.rollout_fraction == 0.5
    assert base.cluster.rollout_fraction == 0.75  # the base is not touched


def test_measurement_needs_numbers():
    with pytest.raises(ValueError, match="measured throughputs"):
        Measurement(0.75, 0.0, 8.0, 4000.0, ((10,),))
    with pytest.raises(ValueError, match="answer_lengths"):
        Measurement(0.75, 100.0, 8.0, 4000.0, ())


def test_grown_profile_by_hand():
    base = load_profile("paper_1p5b")  # written as f(b) = b / (2.5 ms + 0.07 ms b), trainer 8000 tok/s
    a, k = decode_model(base)
    assert a == pytest.approx(2.5e-3, rel=1e-3) and k == pytest.approx(0.07e-3, rel=1e-3)
    p = grown_profile(base, 2.0)
    assert p.lengths.median_tokens == 8000
    assert p.rollout.max_batch_per_gpu == 64  # KV cache holds half as many sequences
    assert p.rollout.gpu_tokens_per_s(64) == pytest.approx(64 / (2.5e-3 + 0.14e-3 * 64), rel=1e-3)  # 5585
    assert p.trainer.tokens_per_s_per_gpu == pytest.approx(8000 / 1.5)  # half the cost is attention
    assert grown_profile(base, 2.0, attention_share=0.0).trainer.tokens_per_s_per_gpu == 8000
    with pytest.raises(ValueError, match="attention_share"):
        grown_profile(base, 2.0, attention_share=2.0)


def test_recommend_moves_nodes_to_the_bottleneck():
    # a trainer 20x faster than the paper's: generation is the bottleneck at a 25% rollout split
    p = load_profile(
        "paper_1p5b", [*SMALL, "cluster.rollout_fraction=0.25", "trainer.tokens_per_s_per_gpu=160000"]
    )
    rec = recommend(p)
    choice = choose_rollout_fraction(p)
    assert rec.current_fraction == 0.25
    assert rec.rollout_fraction == choice.best.fraction > 0.25
    assert rec.tokens_per_s_current == pytest.approx(run_async(p).tokens_per_s)
    assert rec.tokens_per_s_best == pytest.approx(run_async(p, rec.rollout_fraction).tokens_per_s)
    assert rec.expected_gain > 1.0
    assert rec.metrics() == {
        "plan/recommended_rollout_fraction": rec.rollout_fraction,
        "plan/expected_gain": rec.expected_gain,
    }


def test_recommend_keeps_the_best_split():
    p = load_profile("paper_1p5b", SMALL)
    best = choose_rollout_fraction(p).best.fraction
    p.cluster.rollout_fraction = best
    rec = recommend(p)
    assert rec.rollout_fraction == best and rec.expected_gain == 1.0


def test_growth_without_growth_changes_nothing():
    r = growth_comparison(load_profile("paper_1p5b", SMALL), (1.0, 1.0), 10, 600.0)
    assert r.changes == 0 and r.gain == 1.0
    assert r.static_s == pytest.approx(20 * r.windows[0].static.step_s)


def test_growth_replanning_follows_longer_answers():
    p = load_profile("paper_1p5b", SMALL)
    r = growth_comparison(p, (1.0, 4.0, 4.0), 10, 0.0)
    w0, w1, w2 = r.windows
    # window 1 still runs the start's plan (the controller measures the longer answers there)
    assert w1.replanned_fraction == w0.static_fraction == w1.static_fraction
    assert w2.replanned_fraction == choose_rollout_fraction(grown_profile(p, 4.0)).best.fraction
    assert w2.replanned_fraction > w2.static_fraction  # longer answers: more rollout
    assert r.changes == 1
    assert r.replanned_s == pytest.approx(10 * (w0.static.step_s + w1.static.step_s + w2.replanned.step_s))
    assert r.gain > 1.0
    with pytest.raises(ValueError, match="length factors"):
        growth_comparison(p, (1.0,), 10, 0.0)


def test_growth_keeps_the_split_below_the_gain_threshold():
    p = load_profile("paper_1p5b", SMALL)
    r = growth_comparison(p, (1.0, 4.0, 4.0), 10, 0.0, min_gain=100.0)
    assert r.changes == 0 and r.gain == 1.0
    assert all(w.replanned_fraction == w.static_fraction for w in r.windows)
