"""Reward models on real SGLang servers (CPU engine), started as the job starts them
(`python -m areal_jobs.rollout.reward_server`, registered in RUN_DIR/reward_servers/) and scored
through the scorer the controller builds (rollout/reward_client.build_model_scorer).

One server at a time: each class starts its own (class scope) and stops it before the next.
- the committed built-in reward model (a Qwen2ForSequenceClassification): the served scores are
  Hugging Face's, computed in float64 on the same ids;
- the committed built-in policy as a generative judge: it solves the problem itself and the
  verdict is whether its answer matches the response's (reward.model.parser=answer_match); a verdict
  cut short is a failed reward (model_error), never a 0.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from areal_jobs.api import RewardRequest, RewardResult, RewardStatus
from areal_jobs.config import (
    JobConfig,
    RewardConfig,
    RewardModelConfig,
    RewardModelKind,
    RewardSource,
    RolloutConfig,
    RunConfig,
    VerdictParser,
    save_job_config,
)
from areal_jobs.rollout.reward_client import build_model_scorer
from areal_jobs.tasks import arith_task
from areal_jobs.tasks.warm_start.reward_model import PACKAGED_RM_DIR
from areal_jobs.tasks.warm_start.tiny_model import PACKAGED_DIR as POLICY_DIR
from areal_jobs.transport import discovery

REPO = Path(__file__).resolve().parents[3]
ANSWER_RE = r"The answer is (-?\d+)\."


class ArithVerifier:
    """The verifier's side of the combined scorer, in process (the reward workers are not under test)."""

    async def score_group(self, requests):
        return [arith_task.reward(r.response, r.reference) for r in requests]

    def metrics(self):
        return {}


def start_reward_server(run_dir: Path, reward: RewardConfig):
    """The reward-model server process of a job whose config is `reward`; waits for its registration."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = JobConfig(
        run=RunConfig(name=run_dir.name), rollout=RolloutConfig(max_total_tokens=8192), reward=reward
    )
    save_job_config(cfg, run_dir / "config.yaml")
    token = secrets.token_hex(8)
    env = dict(
        os.environ,
        AREAL_JOB_TOKEN=token,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    log = (run_dir / "reward-server.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_jobs.rollout.reward_server", "--config", str(run_dir / "config.yaml"), "--index", "0"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 900
    while not discovery.read_servers(run_dir, discovery.REWARD_SERVERS):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(
                f"reward server did not register:\n{(run_dir / 'reward-server.log').read_text()[-3000:]}"
            )
        time.sleep(0.5)
    return cfg, token, proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()  # the server process forwards it to SGLang's process group
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=30)


def problems(n: int) -> list[arith_task.ArithProblem]:
    return [arith_task.eval_problem_at(7, i) for i in range(n)]


class TestDiscriminative:
    @pytest.fixture(scope="class")
    def served(self, tmp_path_factory):
        reward = RewardConfig(
            source=RewardSource.model, model=RewardModelConfig(path=str(PACKAGED_RM_DIR), batch_size=4)
        )
        run_dir = tmp_path_factory.mktemp("rm-run")
        cfg, token, proc = start_reward_server(run_dir, reward)
        try:
            yield cfg, token, run_dir
        finally:
            stop(proc)

    def test_served_scores_are_hugging_faces(self, served):
        import torch
        from transformers import AutoTokenizer, Qwen2ForSequenceClassification

        cfg, token, run_dir = served
        # right answers, misconceived ones and answers without a final sentence
        rows = []
        for p in problems(6):
            wrong, _ = arith_task.worked_solution(
                p.start, p.ops, misconception_rate=1.0, rng=__import__("random").Random(0)
            )
            rows += [(p, p.solution), (p, wrong), (p, p.solution.split(" The answer")[0])]
        requests = [RewardRequest("arith", a, str(p.answer), p.prompt) for p, a in rows]

        async def score():
            scorer, pool = build_model_scorer(cfg, run_dir, token, ArithVerifier(), start_s=60)
            try:
                return await scorer.score_group(requests), scorer.metrics()
            finally:
                await pool.close()

        results, metrics = asyncio.run(score())
        assert all(r.status is RewardStatus.ok for r in results), [r.detail for r in results]
        tok = AutoTokenizer.from_pretrained(str(PACKAGED_RM_DIR))
        model = Qwen2ForSequenceClassification.from_pretrained(
            str(PACKAGED_RM_DIR), dtype=torch.float64
        ).eval()
        with torch.no_grad():
            ref = [
                model(
                    input_ids=torch.tensor(
                        [
                            tok.encode(r.prompt, add_special_tokens=False)
                            + tok.encode(r.response, add_special_tokens=False)
                        ]
                    )
                )
                .logits[0, 0]
                .item()
                for r in requests
            ]
        served_logits = np.array([float(r.detail.removeprefix("logit ")) for r in results])
        # float32 serving vs a float64 reference of a 2-layer, 128-wide model: a few float32 ulps of
        # the hidden state's scale per layer; 1e-4 is ~800 ulps at 1.0 and far below the scores' spread
        np.testing.assert_allclose(served_logits, ref, atol=1e-4, rtol=0)
        np.testing.assert_allclose(
            [r.reward for r in results], 1 / (1 + np.exp(-np.array(ref))), atol=3e-5, rtol=0
        )
        # three answers per problem in one group of 18: batches of reward.model.batch_size=4
        assert metrics["reward/model_ok"] == 18 and metrics["reward/model_calls"] == 5
        assert metrics["reward/model_judged"] == 18  # the verifier scored every one beside it

    def test_a_server_that_is_gone_fails_the_reward_at_its_deadline(self, served):
        cfg, token, run_dir = served
        dead = run_dir.parent / (run_dir.name + "-dead")
        discovery.register_server(
            dead, 0, "127.0.0.1", discovery.free_port(), folder=discovery.REWARD_SERVERS
        )
        model = RewardModelConfig(path=cfg.reward.model.path, request_timeout_s=0.5, deadline_s=2.0)
        cfg = JobConfig(reward=RewardConfig(source=RewardSource.model, model=model))

        async def score() -> tuple[list[RewardResult], dict]:
            scorer, pool = build_model_scorer(cfg, dead, token, ArithVerifier(), start_s=5)
            try:
                return await scorer.score_group(
                    [RewardRequest("arith", " 1; a: 1+1=2. The answer is 2.", "2", "Q")]
                ), scorer.metrics()
            finally:
                await pool.close()

        (result,), metrics = asyncio.run(score())
        assert result.status is RewardStatus.model_error and result.reward == 0.0
        assert metrics["reward/model_errors"] == 1 and metrics["reward/model_ok"] == 0


class TestJudge:
    @pytest.fixture(scope="class")
    def judged(self, tmp_path_factory):
        model = RewardModelConfig(
            kind=RewardModelKind.generative, path=str(POLICY_DIR), judge_template="{prompt}",
            parser=VerdictParser.answer_match, verdict_regex=ANSWER_RE, judge_max_new_tokens=200,
        )  # fmt: skip
        run_dir = tmp_path_factory.mktemp("judge-run")
        cfg, token, proc = start_reward_server(run_dir, RewardConfig(source=RewardSource.model, model=model))
        try:
            yield cfg, token, run_dir
        finally:
            stop(proc)

    def test_the_built_in_policy_judges_by_solving_the_problem_itself(self, judged):
        import torch
        from transformers import AutoTokenizer, Qwen2ForCausalLM

        cfg, token, run_dir = judged
        # the judge's own (greedy) answers, computed by Hugging Face
        tok = AutoTokenizer.from_pretrained(str(POLICY_DIR))
        policy = Qwen2ForCausalLM.from_pretrained(str(POLICY_DIR), dtype=torch.float32).eval()
        requests, expected = [], []
        for p in problems(4):
            ids = torch.tensor([tok.encode(p.prompt, add_special_tokens=False)])
            with torch.no_grad():
                out = policy.generate(
                    input_ids=ids, max_new_tokens=200, do_sample=False, pad_token_id=0, eos_token_id=0
                )
            own = arith_task.extract_answer(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
            assert own is not None
            other = (own + 1) % 10
            requests += [RewardRequest("arith", f" The answer is {own}.", str(p.answer), p.prompt),
                         RewardRequest("arith", f" The answer is {other}.", str(p.answer), p.prompt)]  # fmt: skip
            expected += [1.0, 0.0]

        async def score(config: JobConfig, reqs):
            scorer, pool = build_model_scorer(config, run_dir, token, ArithVerifier(), start_s=60)
            try:
                return await scorer.score_group(reqs), scorer.metrics()
            finally:
                await pool.close()

        results, _ = asyncio.run(score(cfg, requests))
        assert [r.status for r in results] == [RewardStatus.ok] * len(requests), [r.detail for r in results]
        assert [r.reward for r in results] == expected
        # a verdict cut short (4 tokens: no "The answer is N.") cannot be read: a failed reward
        short = dataclasses_replace_model(cfg, judge_max_new_tokens=4)
        results, metrics = asyncio.run(score(short, requests[:2]))
        assert [r.status for r in results] == [RewardStatus.model_error] * 2
        assert metrics["reward/model_unparsed"] == 2 and metrics["reward/model_failed"] == 2


def dataclasses_replace_model(cfg: JobConfig, **changes) -> JobConfig:
    import dataclasses

    model = dataclasses.replace(cfg.reward.model, **changes)
    return dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, model=model))
