"""The training loop on rank 0, phase by phase:

    wait for B fresh groups ─▶ assemble batch ─▶ train step (v -> v+1) ─▶ publish weights ─▶ log

Batches take the oldest groups first (by their oldest token), so long answers admitted early are
trained before they expire. A group whose oldest token is older than the staleness bound is
returned to the controller at once and generated again: nothing stale is trained, nothing lost.
Every trained sample id is appended to ledger.jsonl with its step and token versions.

algo.exact_delay = d: the trainer at version v takes only groups sampled under version
max(0, v - d) (data/staleness.exact_delay_batch), and publishes v + 1 only once it holds the next
d batches (exact_delay_may_publish), so no request is in flight at an update and every sample
has one version: realised staleness is exactly d from step d on (docs/protocols.md).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from areal_jobs.api import UNSCORED_STATUSES, TrainBackend
from areal_jobs.config import AlgoConfig
from areal_jobs.data.answer_lengths import LengthStats
from areal_jobs.data.source_metrics import eval_source_metrics, source_metrics
from areal_jobs.metrics import MetricsSink
from areal_jobs.staleness import exact_delay_batch, exact_delay_may_publish, exact_delay_target
from areal_jobs.staleness_bound import drift_of
from areal_jobs.trainer.intake.batch import TrainBatch, assemble, split_fresh
from areal_jobs.trainer.intake.inbox import Inbox
from areal_jobs.trainer.objective.staleness_watch import PreclipWatch
from areal_jobs.trainer.publish.publisher import WeightPublisher
from areal_jobs.transport import messages as m

logger = logging.getLogger(__name__)


class Preempted(Exception):
    """SIGUSR1/SIGTERM arrived: checkpoint at the last finished step and exit."""


class TrainLoop:
    def __init__(
        self,
        algo: AlgoConfig,
        backend: TrainBackend,
        inbox: Inbox,
        publisher: WeightPublisher,
        sink: MetricsSink,
        ledger_path: Path,
        batch_wait_timeout_s: float,
        max_new_tokens: int = 0,
    ) -> None:
        self.algo = algo
        self.backend = backend
        self.inbox = inbox
        self.publisher = publisher
        self.sink = sink
        self.ledger_path = ledger_path
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self.max_new_tokens = max_new_tokens  # rollout.max_new_tokens: overlong shaping, Dr.GRPO norm
        self.version = 0
        self.step = 0
        self.max_staleness_seen = 0
        self.trained_tokens = 0
        self.expired_groups = 0
        self.preempt = threading.Event()  # set by the signal handler; checked between phases
        # (step, groups) -> None: samples.jsonl every run.samples_every_steps (session sets it)
        self.dump_samples: Callable[[int, list[m.TrajectoryGroup]], None] | None = None
        self.preclip_watch: PreclipWatch | None = None  # run.preclip_warn_fraction (session sets it)

    def take_groups(self) -> list[m.TrajectoryGroup]:
        """B fresh groups, oldest first; expired ones are sent back to be regenerated."""
        b = self.algo.batch_size
        while True:
            if self.preempt.is_set():
                raise Preempted()
            if self.inbox.take_weights_needed():
                self.publisher.publish(self.version, self.backend, trained=())
            interrupt = lambda: self.preempt.is_set() or self.inbox.weights_needed  # noqa: E731
            if not self.inbox.wait_groups(b, self.batch_wait_timeout_s, interrupt):
                continue
            fresh, expired = split_fresh(self.inbox.take_groups(), self.version, self.algo.max_staleness)
            if expired:
                self.expired_groups += len(expired)
                logger.info("%d groups expired at version %d; regenerating", len(expired), self.version)
                self.inbox.send(m.GroupsExpired(tuple(g.group_id for g in expired)))
            if self.algo.exact_delay >= 0:
                picked = exact_delay_batch(
                    [g.oldest_version for g in fresh], self.version, self.algo.exact_delay, b
                )
                if picked is not None:
                    taken = set(picked)
                    self.inbox.put_back([g for i, g in enumerate(fresh) if i not in taken])
                    return [fresh[i] for i in picked]
                self.inbox.put_back(fresh)
                # fewer than B groups old enough, the rest newer: wait for another one to arrive
                self.inbox.wait_groups(len(fresh) + 1, self.batch_wait_timeout_s, interrupt)
                continue
            order = sorted(range(len(fresh)), key=lambda i: (fresh[i].oldest_version, i))
            if len(fresh) >= b:
                chosen = set(order[:b])
                self.inbox.put_back([g for i, g in enumerate(fresh) if i not in chosen])
                return [fresh[i] for i in sorted(chosen, key=order.index)]
            self.inbox.put_back(fresh)

    def run_step(self) -> dict[str, float]:
        t0 = time.monotonic()
        groups = self.take_groups()
        t_batch = time.monotonic()
        batch = assemble(groups, self.version, self.algo, self.max_new_tokens)
        metrics = self.backend.train_step(batch)
        t_train = time.monotonic()
        self._report_drift(metrics, batch)
        self._wait_for_next_batches()
        t_gate = time.monotonic()
        self.version += 1
        metrics.update(self.publisher.publish(self.version, self.backend, tuple(batch.group_ids)))
        t_end = time.monotonic()
        self.step += 1
        self._write_ledger(batch, groups)
        if self.dump_samples is not None:
            self.dump_samples(self.step, groups)
        metrics.update(self._batch_metrics(batch, groups))
        metrics.update(
            {
                "time/wait_batch_s": t_batch - t0,
                "time/step_train_s": t_train - t_batch,
                "time/publish_s": t_end - t_gate,
                "time/exact_delay_wait_s": t_gate - t_train,
                "time/step_s": t_end - t0,
                "throughput/trained_tokens_per_s": batch.num_output_tokens / max(t_end - t0, 1e-9),
                # prompt + output tokens per second of compute: the trainer's speed (re-planning)
                "throughput/train_tokens_per_s": sum(len(s.input_ids) for s in batch.samples)
                / max(t_train - t_batch, 1e-9),
                "buffer/groups_waiting": float(len(self.inbox.groups)),
                "buffer/expired_groups": float(self.expired_groups),
                "train/version": float(self.version),
            }
        )
        metrics.update(self.inbox.rollout_stats)
        self.sink.log(self.step, metrics)
        warning = self.preclip_watch.update(self.step, metrics) if self.preclip_watch else None
        if warning:
            logger.warning("%s", warning)
        self.log_evals()
        return metrics

    def _report_drift(self, metrics: dict[str, float], batch: TrainBatch) -> None:
        """algo.max_staleness=auto: the step's drift to the controller, which moves the admission
        bound (areal_jobs/staleness_bound.py); sent before the PauseRequest, so the bound the next
        VersionPublished reports (staleness/bound) has taken this step into account."""
        if not self.algo.staleness_auto:
            return
        drift = drift_of(metrics, self.algo.staleness_drift)
        if drift is None:
            return
        lag = batch.staleness()
        self.inbox.send(m.DriftReport(self.version + 1, drift, float(lag.mean()) if lag.size else 0.0))

    def _wait_for_next_batches(self) -> None:
        """algo.exact_delay = d: before publishing the next version, hold the next d batches
        (every group of the current version delivered, none in flight). Not for d = 0
        (synchronous already). The last step waits too, though nothing trains after it: otherwise
        the groups still running meet the final update, continue under the new weights and count
        as straddled (the gate costs about one step's wait, once). Preemption waits for this
        (bounded by trainer.batch_wait_timeout_s): the step's weights are trained but not yet
        published, not a state to checkpoint."""
        d, b = self.algo.exact_delay, self.algo.batch_size
        if d <= 0:
            return
        if not exact_delay_may_publish(len(self.inbox.groups), d, b):
            self.inbox.wait_groups(d * b, self.batch_wait_timeout_s)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "version": self.version,
            "max_staleness_seen": self.max_staleness_seen,
            "trained_tokens": self.trained_tokens,
            "expired_groups": self.expired_groups,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("step", "version", "max_staleness_seen", "trained_tokens", "expired_groups"):
            setattr(self, key, int(state[key]))

    def log_evals(self) -> None:
        """Each evaluation at the step it arrived, keyed to the policy version it measured."""
        for ev in self.inbox.take_evals():
            if ev.kind.endswith("_greedy"):
                row = {"eval/greedy": ev.accuracy, "eval/greedy_accuracy": ev.accuracy,
                       "eval/greedy_mean_reward": ev.mean_reward, "eval/greedy_version": float(ev.version),
                       **{k.replace("/accuracy", "/greedy_accuracy"): v for k, v in eval_source_metrics(ev.by_source).items()}}  # fmt: skip
            else:
                row = {
                    "eval/pass@1": ev.accuracy,
                    "eval/accuracy": ev.accuracy,  # the same as eval/pass@1, kept for older readers
                    "eval/pass@k": ev.pass_at_k,
                    "eval/k": float(ev.k),
                    "eval/mean_reward": ev.mean_reward,
                    "eval/mean_length_tokens": ev.mean_length_tokens,
                    "eval/truncation_rate": ev.truncation_rate,
                    "eval/version": float(ev.version),
                    **eval_source_metrics(ev.by_source),  # eval/<source>/accuracy (mixtures)
                }
            self.sink.log(self.step, row)

    def _batch_metrics(self, batch: TrainBatch, groups: list[m.TrajectoryGroup]) -> dict[str, float]:
        samples = [s for g in groups for s in g.samples]
        # a failed reward (the reward model's, a user function's) is no 0: out of the mean as of the batch
        rewards = np.array(
            [s.reward for s in samples if s.reward_status not in UNSCORED_STATUSES], dtype=np.float64
        )
        lengths = np.array([s.num_tokens for s in samples], dtype=np.float64)
        lag = batch.staleness()
        self.trained_tokens += batch.num_output_tokens
        if lag.size:
            self.max_staleness_seen = max(self.max_staleness_seen, int(lag.max()))
        exact = {}
        if self.algo.exact_delay >= 0 and lag.size:
            target = batch.version - exact_delay_target(batch.version, self.algo.exact_delay)
            exact = {
                "staleness/target": float(target),
                "staleness/on_target_fraction": float((lag == target).mean()),
            }
        return {
            **exact,
            "reward/mean": float(rewards.mean()) if rewards.size else 0.0,
            "reward/accuracy": float((rewards >= 1.0).mean()) if rewards.size else 0.0,
            "reward/non_ok": float(sum(s.reward_status != "ok" for s in samples)),
            "staleness/min": float(lag.min()) if lag.size else 0.0,
            "staleness/mean": float(lag.mean()) if lag.size else 0.0,
            "staleness/max": float(lag.max()) if lag.size else 0.0,
            "staleness/p50": float(np.percentile(lag, 50)) if lag.size else 0.0,
            "staleness/p90": float(np.percentile(lag, 90)) if lag.size else 0.0,
            "gen/len_mean": float(lengths.mean()),
            "gen/len_max": float(lengths.max()),
            "gen/len_p50": float(np.percentile(lengths, 50)),
            "gen/len_p90": float(np.percentile(lengths, 90)),
            "gen/prompt_len_mean": float(np.mean([len(g.prompt_ids) for g in groups])),
            # what launch/run/replanner.py fits the simulator's length model to
            **LengthStats.of_groups([[s.num_tokens for s in g.samples] for g in groups]).metrics(),
            "gen/interrupted_samples": float(sum(s.num_interruptions > 0 for s in samples)),
            "gen/truncated_samples": float(sum(s.finish_reason == "length" for s in samples)),
            "gen/truncation_rate": float(np.mean([s.finish_reason == "length" for s in samples])),
            # per trained batch (the controller's rollout/ counters are run-long means)
            "episode/turns": float(np.mean([s.num_turns for s in samples])),
            "episode/tool_calls": float(np.mean([s.num_tool_calls for s in samples])),
            "batch/filtered_groups": float(len(batch.filtered_group_ids)),
            "batch/unscored_samples": float(batch.unscored_samples),
            # how long a group waited for its rewards after its answers were generated, and that
            # wait's share of the group's time (single_turn; other workflows score inside gen_time_s)
            "timing/reward_wait_s": float(np.mean([g.reward_time_s for g in groups])),
            "timing/reward_wait_share": float(
                sum(g.reward_time_s for g in groups)
                / max(sum(g.gen_time_s + g.reward_time_s for g in groups), 1e-9)
            ),
            "batch/trained_sequences": float(len(batch.samples)),
            **source_metrics(groups),  # source/<name>/{reward,accuracy,length,truncated} (mixtures)
        }

    def _write_ledger(self, batch: TrainBatch, groups: list[m.TrajectoryGroup]) -> None:
        row = {
            "step": self.step,
            "trained_at_version": batch.version,
            "groups": [g.group_id for g in groups],
            "data_indices": [g.data_index for g in groups],
            "samples": [s.sample_id for g in groups for s in g.samples],
            "oldest_version": min(g.oldest_version for g in groups),
            "max_staleness": int(batch.staleness().max()) if batch.samples else 0,
        }
        with self.ledger_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
