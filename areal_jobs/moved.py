"""Former module names, kept working for one release after the rooms of issue 45.

`import bench.ablate`, `from areal_jobs.data import staleness` and `python -m bench.ablate ...`
still work: a finder at the end of `sys.meta_path` (consulted only for names no file answers, so
it costs nothing for the names that exist) maps each former name to its module's new name, with a
FutureWarning naming the new one. The module object is the new one itself (one module, one
state), and runpy gets the new file's code, so `python -m` runs it under its new path.

Installed by importing `areal_jobs` (bench/ and launch/planning/ import it for theirs; not launch/,
whose `python -m launch.slurm status` imports nothing beyond the standard library). Remove after the
next release, together with the table.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

# former name -> current name (written by the move; docs/architecture.md, "What moved")
MOVED: dict[str, str] = {
    "areal_jobs.agent.tool_warm_start": "areal_jobs.tasks.warm_start.tool_warm_start",
    "areal_jobs.data.arith_task": "areal_jobs.tasks.arith_task",
    "areal_jobs.data.arith_tools": "areal_jobs.tasks.arith_tools",
    "areal_jobs.data.countdown_model": "areal_jobs.tasks.warm_start.countdown_model",
    "areal_jobs.data.countdown_task": "areal_jobs.tasks.countdown_task",
    "areal_jobs.data.eval_metrics": "areal_jobs.rollout.eval_metrics",
    "areal_jobs.data.fact_probe": "areal_jobs.tasks.warm_start.fact_probe",
    "areal_jobs.data.packing": "areal_jobs.trainer.intake.packing",
    "areal_jobs.data.reward_model": "areal_jobs.tasks.warm_start.reward_model",
    "areal_jobs.data.staleness": "areal_jobs.staleness",
    "areal_jobs.data.staleness_bound": "areal_jobs.staleness_bound",
    "areal_jobs.data.tiny_model": "areal_jobs.tasks.warm_start.tiny_model",
    "areal_jobs.data.tiny_moe_model": "areal_jobs.tasks.warm_start.tiny_moe_model",
    "areal_jobs.trainer.advantages": "areal_jobs.trainer.objective.advantages",
    "areal_jobs.trainer.attention": "areal_jobs.trainer.forward.attention",
    "areal_jobs.trainer.batch": "areal_jobs.trainer.intake.batch",
    "areal_jobs.trainer.batch_broadcast": "areal_jobs.trainer.intake.batch_broadcast",
    "areal_jobs.trainer.dp_plan": "areal_jobs.trainer.intake.dp_plan",
    "areal_jobs.trainer.gpu_memory": "areal_jobs.trainer.dist.gpu_memory",
    "areal_jobs.trainer.hf_logprobs": "areal_jobs.trainer.forward.hf_logprobs",
    "areal_jobs.trainer.inbox": "areal_jobs.trainer.intake.inbox",
    "areal_jobs.trainer.layer_compile": "areal_jobs.trainer.forward.layer_compile",
    "areal_jobs.trainer.logprob_kernels": "areal_jobs.trainer.forward.logprob_kernels",
    "areal_jobs.trainer.logprobs": "areal_jobs.trainer.forward.logprobs",
    "areal_jobs.trainer.lora": "areal_jobs.trainer.forward.lora",
    "areal_jobs.trainer.loss": "areal_jobs.trainer.objective.loss",
    "areal_jobs.trainer.loss_stats": "areal_jobs.trainer.objective.loss_stats",
    "areal_jobs.trainer.minibatches": "areal_jobs.trainer.intake.minibatches",
    "areal_jobs.trainer.objectives": "areal_jobs.trainer.objective.objectives",
    "areal_jobs.trainer.packed_attention": "areal_jobs.trainer.forward.packed_attention",
    "areal_jobs.trainer.process_group": "areal_jobs.trainer.dist.process_group",
    "areal_jobs.trainer.publisher": "areal_jobs.trainer.publish.publisher",
    "areal_jobs.trainer.ranks": "areal_jobs.trainer.dist.ranks",
    "areal_jobs.trainer.router_loss": "areal_jobs.trainer.objective.router_loss",
    "areal_jobs.trainer.staleness_watch": "areal_jobs.trainer.objective.staleness_watch",
    "areal_jobs.trainer.state_bytes": "areal_jobs.trainer.dist.state_bytes",
    "areal_jobs.trainer.torch_backend": "areal_jobs.trainer.torch.backend",
    "bench.ablate": "bench.staleness.ablate",
    "bench.ablation_probe": "bench.staleness.ablation_probe",
    "bench.ablation_table": "bench.staleness.ablation_table",
    "bench.activation_memory": "bench.trainer.activation_memory",
    "bench.auto_eta": "bench.staleness.auto_eta",
    "bench.controller_bench": "bench.rollout.controller_bench",
    "bench.e2e_bench": "bench.e2e.e2e_bench",
    "bench.e2e_runs": "bench.e2e.e2e_runs",
    "bench.engine_bench": "bench.rollout.engine_bench",
    "bench.gpu_trainer": "bench.trainer.gpu_trainer",
    "bench.gpu_trainer_point": "bench.trainer.gpu_trainer_point",
    "bench.gpu_trainer_report": "bench.trainer.gpu_trainer_report",
    "bench.logprob_memory_bench": "bench.trainer.logprob_memory_bench",
    "bench.offpolicy_cost": "bench.staleness.offpolicy_cost",
    "bench.packing_bench": "bench.trainer.packing_bench",
    "bench.pause_bench": "bench.rollout.pause_bench",
    "bench.prefix_salt_bench": "bench.rollout.prefix_salt_bench",
    "bench.prox_logp_bench": "bench.staleness.prox_logp_bench",
    "bench.reward_bench": "bench.reward.reward_bench",
    "bench.reward_model_bench": "bench.reward.reward_model_bench",
    "bench.reward_overhead_bench": "bench.reward.reward_overhead_bench",
    "bench.sandbox_bench": "bench.reward.sandbox_bench",
    "bench.trainer_bench": "bench.trainer.trainer_bench",
    "bench.trainer_memory_bench": "bench.trainer.trainer_memory_bench",
    "bench.trainer_memory_point": "bench.trainer.trainer_memory_point",
    "bench.weight_delta_bench": "bench.weights.weight_delta_bench",
    "bench.weight_sync_bench": "bench.weights.weight_sync_bench",
    "launch.planning.allocation": "launch.planning.layout.allocation",
    "launch.planning.autoscale": "launch.planning.replanning.autoscale",
    "launch.planning.fault_report": "launch.planning.reports.fault_report",
    "launch.planning.gpu_shares": "launch.planning.fit.gpu_shares",
    "launch.planning.kv_cache": "launch.planning.fit.kv_cache",
    "launch.planning.memory": "launch.planning.fit.memory",
    "launch.planning.memory_plan": "launch.planning.fit.memory_plan",
    "launch.planning.model_shape": "launch.planning.fit.model_shape",
    "launch.planning.placement": "launch.planning.layout.placement",
    "launch.planning.plan": "launch.planning.layout.plan",
    "launch.planning.replan": "launch.planning.replanning.replan",
    "launch.planning.reward_plan": "launch.planning.fit.reward_plan",
    "launch.planning.simulate": "launch.planning.reports.simulate",
    "launch.planning.small_clusters": "launch.planning.layout.small_clusters",
    "launch.planning.suggest": "launch.planning.layout.suggest",
    "launch.planning.weights_report": "launch.planning.reports.weights_report",
}


def message(old: str) -> str:
    return f"{old} moved to {MOVED[old]}; the old name works until the next release (docs/architecture.md)"


class _Alias(importlib.abc.Loader):
    """Loads a former name as the module of its new name."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)  # attributes kept: _init_module_attrs won't override

    def exec_module(self, module) -> None:
        pass  # the new module ran already

    def get_code(self, fullname: str):  # runpy (`python -m old.name`)
        spec = importlib.util.find_spec(self.new)
        return spec.loader.get_code(self.new)


class MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(message(fullname), FutureWarning, stacklevel=2)
        target_spec = importlib.util.find_spec(new)
        if target_spec is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), origin=target_spec.origin)


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
