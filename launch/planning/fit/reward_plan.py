"""The reward-model component of a planned job: do its servers fit their GPUs, and keep up?

    report = check_reward_servers(job, plan)   # None without reward-model nodes; ValueError refuses
    print(report.describe())

Memory: one server holds the reward model's weights (its shape from reward.model.path's
config.json, else the named reward.model.shape) split over reward.model.tp_size GPUs, and the KV
cache of the answers it scores at once (reward.model.batch_size answers of prompt + the longest
answer; a judge adds judge_max_new_tokens), within SGLang's static share of the GPU
(launch/planning/fit/kv_cache.py, the same model as the rollout servers'). A server whose weights or
one batch do not fit is refused, naming reward.model.tp_size / batch_size.

Throughput: the rollout produces answers at about (rollout servers x their decode tokens/s at
their largest batch, from cluster.allocation_profile) / (the profile's mean answer length)
answers/s; the reward servers score reward.model.answers_per_s each (a figure measured by
`python -m bench --only reward_model`, not modelled). A layout whose reward servers score fewer
answers per second than the rollout produces is refused, naming the cluster.reward_nodes that keeps
up: each answer waits for its reward, so a slow reward tier stalls admission and the trainer. With
reward.model.answers_per_s=0 the block says the check was skipped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from areal_jobs.config import JobConfig, RewardModelKind
from launch.planning.fit.kv_cache import KvCachePlan, kv_cache_plan, mean_answer_tokens
from launch.planning.fit.memory import GIB
from launch.planning.fit.model_shape import ModelShape, resolve_shape
from launch.planning.layout.plan import AllocationPlan, plural
from launch.planning.sim.profile import load_profile


@dataclass(frozen=True)
class RewardPlan:
    servers: int
    shape: ModelShape | None
    kv: KvCachePlan | None
    needed_answers_per_s: float  # the rollout's answer rate (the profile's estimate)
    answers_per_s_per_server: float  # reward.model.answers_per_s (0 = not measured)

    @property
    def capacity_answers_per_s(self) -> float:
        return self.servers * self.answers_per_s_per_server

    def describe(self) -> str:
        lines = [f"reward-model servers: {plural(self.servers, 'server')}"]
        if self.kv is None:
            lines.append(
                "  memory not checked: reward.model.path has no config.json here; set reward.model.shape"
            )
        else:
            lines.append(
                "  " + self.kv.describe().replace("rollout KV cache", "reward-model KV cache").split("\n")[0]
            )
            lines.append(
                f"  one batch ({self.kv.concurrency} answers x {self.kv.longest_tokens:,} tokens) fits"
            )
        if self.answers_per_s_per_server:
            lines.append(
                f"  keep up: {self.servers} x {self.answers_per_s_per_server:g} answers/s (reward.model.answers_per_s) = {self.capacity_answers_per_s:,.0f}/s >= the rollout's ~{self.needed_answers_per_s:,.0f}/s"
            )
        else:
            lines.append(
                f"  keep up: not checked (reward.model.answers_per_s=0): the rollout produces "
                f"~{self.needed_answers_per_s:,.0f} answers/s; measure one server with `python -m bench --only reward_model`"
            )
        return "\n".join(lines)


def rollout_answers_per_s(job: JobConfig, plan: AllocationPlan) -> float:
    """The rollout's answer rate: every server at its largest batch's decode speed, over the mean
    answer length (cluster.allocation_profile; an estimate, as the simulator's)."""
    profile = load_profile(job.cluster.allocation_profile)
    tokens_per_s = max(profile.rollout.tokens_per_s) * plan.rollout_tp  # the profile's table is per GPU
    return plan.num_servers * tokens_per_s / mean_answer_tokens(profile.lengths, job.rollout.max_new_tokens)


def check_reward_servers(job: JobConfig, plan: AllocationPlan) -> RewardPlan | None:
    """The reward component's report, None without one; ValueError naming the fix when it cannot work."""
    if not plan.reward_nodes:
        return None
    rm = job.reward.model
    rm_job = dataclasses.replace(
        job,
        model=dataclasses.replace(job.model, path=rm.path, shape=rm.shape),
        rollout=dataclasses.replace(
            job.rollout, engine=rm.engine, tp_size=rm.tp_size, max_concurrent=rm.batch_size
        ),
    )
    shape = resolve_shape(rm_job)
    kv = None
    if shape is not None:
        kv = kv_cache_plan(rm_job, shape, num_servers=1)
        extra = rm.judge_max_new_tokens if rm.kind is RewardModelKind.generative else 0
        kv = dataclasses.replace(kv, longest_tokens=kv.longest_tokens + extra)
        if kv.kv_bytes_per_gpu <= 0:
            raise ValueError(
                f"reward model ({shape.source}) weights of {kv.weights_bytes_per_gpu / GIB:.1f} GiB per GPU leave "
                f"no KV cache on {job.cluster.gpu_memory_gib:g} GiB GPUs: raise reward.model.tp_size"
            )
        if kv.holds_at_longest < rm.batch_size:
            raise ValueError(
                f"a reward-model server holds {kv.holds_at_longest} answers of {kv.longest_tokens:,} tokens, "
                f"fewer than reward.model.batch_size={rm.batch_size}: lower reward.model.batch_size or raise "
                "reward.model.tp_size"
            )
    needed = rollout_answers_per_s(job, plan)
    report = RewardPlan(plan.num_reward_servers, shape, kv, needed, rm.answers_per_s)
    if rm.answers_per_s and report.capacity_answers_per_s < needed:
        per_node = plan.reward_servers_per_node * rm.answers_per_s
        enough = math.ceil(needed / per_node)
        raise ValueError(
            f"the reward-model servers cannot keep up: {plan.num_reward_servers} servers x {rm.answers_per_s:g} "
            f"answers/s (reward.model.answers_per_s) = {report.capacity_answers_per_s:,.0f}/s, but "
            f"{plan.num_servers} rollout servers produce ~{needed:,.0f} answers/s (cluster.allocation_profile="
            f"{job.cluster.allocation_profile}): set cluster.reward_nodes={enough}, or "
            "measure reward.model.answers_per_s on the reward nodes (python -m bench --only reward_model)"
        )
    return report
