"""Allocation planner: how one SLURM job splits its nodes and GPUs between roles.

Pure functions of the config slices, no I/O. launch/planning/layout/placement.py decides which GPUs each role gets
(`cluster.placement`): whole nodes (heterogeneous job: group 0 `floor(nodes * rollout_fraction)`
rollout nodes, group 1 the rest), a GPU-level split (the last node shared by servers and trainer:
1 x 8 GPUs -> 6 + 2), or colocated (one node, servers and trainer time-share every GPU). Rollout
servers: one per `rollout.tp_size` GPUs; trainer: one task per trainer GPU (Megatron TP x PP x DP
or FSDP DP, DP derived), the rollout controller on its first node. Every layout that cannot run
raises ValueError naming the override to change.

`cluster.rollout_fraction=auto` is resolved before planning, by the simulator one layer up
(launch/planning/layout/allocation.py `resolve_auto_fraction`: the split with the highest throughput among the
layouts this planner accepts); `apply_plan` writes the chosen number into the config the roles read.

Worked example (conf/experiment/math_qwen2_1p5b.yaml): 64 nodes x 8 GPUs, fraction 0.75, rollout
TP 1, trainer TP 1 x PP 1 -> 48 rollout nodes (384 GPUs, 384 servers) + 16 trainer nodes
(128 GPUs, DP 128).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from areal_jobs.config import (
    AlgoConfig,
    ClusterConfig,
    JobConfig,
    Placement,
    RewardConfig,
    RewardSource,
    RolloutConfig,
    TrainerBackend,
    TrainerConfig,
    WeightSyncConfig,
)
from launch.planning.fit.gpu_shares import apply_shares, shares_for
from launch.planning.layout.placement import GpuSplit, LayoutError, colocated_schedule, node_split, split_gpus

# Ports used when the config leaves them at 0 ("any free port" only works on one machine).
DEFAULT_SERVER_BASE_PORT = 30000
DEFAULT_CONTROLLER_PORT = 29600
DEFAULT_WEIGHT_SYNC_PORT = 29700
DEFAULT_REWARD_BASE_PORT = 31000


@dataclass(frozen=True)
class AllocationPlan:
    """The layout of one job. Placement nodes: group 0 = rollout nodes, group 1 = trainer nodes +
    controller. gpus / colocated: one job; the first trainer node also hosts `shared_rollout_gpus`
    GPUs of servers (from GPU 0), the trainer uses its GPUs from `trainer_first_gpu` on
    (`trainer_tasks_first_node` ranks there) and `trainer_tasks_per_node` on each later node."""

    gpus_per_node: int
    rollout_nodes: int
    servers_per_node: int
    rollout_tp: int
    trainer_nodes: int
    trainer_tasks_per_node: int  # one per GPU for Megatron; 1 for the single-process torch backend
    trainer_tp: int
    trainer_pp: int
    trainer_dp: int
    server_base_port: int  # server i listens on server_base_port + i
    controller_port: int  # trajectories; control channel on controller_port + 1
    weight_sync_port: int  # store of the weight-broadcast group, on the first trainer node
    trainer_master_port: int  # torch.distributed MASTER_PORT of the trainer ranks
    rollout_fraction: float = 0.0  # the split used (resolved when cluster.rollout_fraction=auto)
    placement: Placement = Placement.nodes  # resolved (never auto)
    shared_rollout_gpus: int = 0  # gpus / colocated: rollout GPUs on the trainer's node
    trainer_first_gpu: int = 0  # gpus: the trainer's GPUs on its first node start here
    trainer_tasks_first_node: int = 0  # gpus / colocated: ranks on the first trainer node
    # the third component (reward.source=model|combined): whole nodes of reward-model servers,
    # het group 2, one server per reward.model.tp_size GPUs; reward server i on reward_base_port + i
    reward_nodes: int = 0
    reward_servers_per_node: int = 0
    reward_tp: int = 1
    reward_base_port: int = 0
    # Megatron's expert parallelism (mixture-of-experts models): experts over EP ranks, each over ETP
    trainer_ep: int = 1
    trainer_etp: int = 1

    @property
    def trainer_layout(self) -> str:
        """ "TP 4 x PP 1 x DP 8", with ", EP 8" (and ", expert TP 2") for expert parallelism."""
        text = f"TP {self.trainer_tp} x PP {self.trainer_pp} x DP {self.trainer_dp}"
        if self.trainer_ep > 1:
            text += f", EP {self.trainer_ep}"
        if self.trainer_etp > 1:
            text += f", expert TP {self.trainer_etp}"
        return text

    @property
    def nodes(self) -> int:
        return self.rollout_nodes + self.trainer_nodes + self.reward_nodes

    @property
    def num_reward_servers(self) -> int:
        return self.reward_nodes * self.reward_servers_per_node

    @property
    def shared_servers(self) -> int:
        return self.shared_rollout_gpus // self.rollout_tp

    @property
    def num_servers(self) -> int:
        return self.rollout_nodes * self.servers_per_node + self.shared_servers

    @property
    def rollout_gpus(self) -> int:
        return self.rollout_nodes * self.gpus_per_node + self.shared_rollout_gpus

    @property
    def trainer_gpus(self) -> int:
        """GPUs of the trainer: its whole nodes, or one per rank on shared nodes."""
        if self.placement is Placement.nodes:
            return self.trainer_nodes * self.gpus_per_node
        return self.trainer_world_size

    @property
    def trainer_world_size(self) -> int:
        if self.placement is Placement.nodes:
            return self.trainer_nodes * self.trainer_tasks_per_node
        return self.trainer_tasks_first_node + (self.trainer_nodes - 1) * self.trainer_tasks_per_node

    @property
    def trainer_gpu_ids(self) -> str:
        """CUDA_VISIBLE_DEVICES of the trainer ranks on the first trainer node ("" = every GPU)."""
        if self.placement is Placement.nodes:
            return ""
        first = self.trainer_first_gpu
        return ",".join(str(i) for i in range(first, first + self.trainer_tasks_first_node))

    def describe(self) -> str:
        """One line for the script header and the submit output."""
        trainer = self.trainer_layout
        servers = f"{plural(self.num_servers, 'server')} of TP {self.rollout_tp}"
        ranks = plural(self.trainer_world_size, "trainer rank")
        if self.placement is Placement.colocated:
            return (
                f"1 node x {plural(self.gpus_per_node, 'GPU')}, colocated: {servers} and {ranks} ({trainer}) "
                f"time-share {gpu_range(0, self.gpus_per_node)} (synchronous: algo.max_staleness=0)"
            )
        if self.placement is Placement.gpus:
            return (
                f"{plural(self.nodes, 'node')} x {plural(self.gpus_per_node, 'GPU')}, GPU-level split "
                f"{self.rollout_gpus} + {self.trainer_gpus}: {servers} on {self.rollout_where()}; "
                f"{ranks} ({trainer}) on {self.trainer_where()}"
            )
        reward = ""
        if self.reward_nodes:
            reward = (
                f" + {plural(self.reward_nodes, 'reward node')} ({plural(self.reward_nodes * self.gpus_per_node, 'GPU')}, "
                f"{plural(self.num_reward_servers, 'reward-model server')} of TP {self.reward_tp})"
            )
        return (
            f"{plural(self.nodes, 'node')} x {plural(self.gpus_per_node, 'GPU')} = "
            f"{plural(self.rollout_nodes, 'rollout node')} ({plural(self.rollout_gpus, 'GPU')}, {servers}) + "
            f"{plural(self.trainer_nodes, 'trainer node')} ({plural(self.trainer_gpus, 'GPU')}, "
            f"{plural(self.trainer_world_size, 'rank')}: {trainer}){reward}"
        )

    @property
    def shared_node(self) -> int:
        """1-based number of the first trainer node (gpus / colocated: the one servers may share)."""
        return self.rollout_nodes + 1

    def rollout_where(self) -> str:
        """Where the servers run: "nodes 1-2 + GPUs 0-1 of node 3", "GPUs 0-5 of node 1"."""
        parts = []
        if self.rollout_nodes:
            parts.append(node_range(1, self.rollout_nodes))
        if self.shared_rollout_gpus:
            parts.append(f"{gpu_range(0, self.shared_rollout_gpus)} of node {self.shared_node}")
        return " + ".join(parts)

    def trainer_where(self) -> str:
        """Where the trainer ranks run: "GPUs 6-7 of node 1", "GPUs 5-7 of node 3 + node 4"."""
        first = (
            f"{gpu_range(self.trainer_first_gpu, self.trainer_tasks_first_node)} of node {self.shared_node}"
        )
        later = self.trainer_nodes - 1
        return first + (f" + {node_range(self.shared_node + 1, later)}" if later else "")


def plural(count: int, noun: str) -> str:
    """ "1 node", "3 nodes", "1 trainer rank" (the nouns used here take an s)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def node_range(first: int, count: int) -> str:
    """ "node 4", "nodes 1-3" (1-based, count >= 1)."""
    return f"node {first}" if count == 1 else f"nodes {first}-{first + count - 1}"


def gpu_range(first: int, count: int) -> str:
    """ "GPU 3", "GPUs 0-5" (count >= 1)."""
    return f"GPU {first}" if count == 1 else f"GPUs {first}-{first + count - 1}"


def split_nodes(cluster: ClusterConfig) -> tuple[int, int]:
    """(rollout nodes, trainer nodes) of the whole-node layout (launch/placement.node_split)."""
    split = node_split(cluster)
    return split.rollout_nodes, split.trainer_nodes


def _servers_per_node(cluster: ClusterConfig, rollout: RolloutConfig) -> int:
    gpus, tp = cluster.gpus_per_node, rollout.tp_size
    if tp > gpus or gpus % tp:
        choices = [d for d in range(1, gpus + 1) if gpus % d == 0]
        raise ValueError(
            f"rollout.tp_size={tp} must divide cluster.gpus_per_node={gpus} (a server does not span "
            f"nodes): use rollout.tp_size in {choices}"
        )
    fit = gpus // tp
    if cluster.servers_per_node > fit:
        raise ValueError(
            f"cluster.servers_per_node={cluster.servers_per_node} servers of rollout.tp_size={tp} need more "
            f"than cluster.gpus_per_node={gpus} GPUs: set cluster.servers_per_node<={fit} (0 = {fit})"
        )
    return cluster.servers_per_node or fit


def _trainer_layout(
    cluster: ClusterConfig, trainer: TrainerConfig, algo: AlgoConfig, split: GpuSplit
) -> tuple[int, int, int, int, int]:
    """(tasks per node, tasks on the first node, tp, pp, dp) of the trainer."""
    gpus, first = split.trainer_gpus, split.trainer_gpus_first_node
    if trainer.backend is TrainerBackend.torch:
        if gpus != 1:
            raise LayoutError(
                f"trainer.backend=torch runs one process, but the trainer has {gpus} GPUs "
                f"({plural(split.trainer_nodes, 'node')}, cluster.placement={split.placement.value}): use "
                "trainer=fsdp or trainer=megatron, or give the trainer one GPU (cluster.gpus_per_node=1, "
                "or cluster.rollout_fraction so that one trainer GPU remains)"
            )
        return 1, 1, 1, 1, 1
    tp, pp = trainer.tp_size, trainer.pp_size
    per_node = {first} | ({cluster.gpus_per_node} if split.trainer_nodes > 1 else set())
    if any(n % tp for n in per_node):
        raise LayoutError(
            f"trainer.tp_size={tp} must divide the trainer's GPUs on each node ({sorted(per_node)}: "
            "tensor parallelism stays inside a node): lower trainer.tp_size, or change "
            "cluster.rollout_fraction / cluster.placement"
        )
    if gpus % (tp * pp):
        raise LayoutError(
            f"trainer.tp_size={tp} x trainer.pp_size={pp} does not divide the {gpus} trainer GPUs: change "
            "trainer.pp_size, trainer.tp_size, cluster.nodes or cluster.rollout_fraction"
        )
    dp = gpus // (tp * pp)
    if trainer.dp_size not in (1, dp):
        raise LayoutError(
            f"trainer.dp_size={trainer.dp_size}, but {gpus} trainer GPUs / (TP {tp} x PP {pp}) give DP {dp}: "
            "drop the trainer.dp_size override (it is derived) or change cluster.nodes"
        )
    experts = trainer.ep_size * trainer.expert_tp_size
    if (tp * dp) % experts:
        raise LayoutError(
            f"trainer.ep_size={trainer.ep_size} x trainer.expert_tp_size={trainer.expert_tp_size} must divide "
            f"TP {tp} x DP {dp} = {tp * dp} (Megatron folds the expert grid onto the same ranks): change "
            "trainer.ep_size, or the trainer's GPUs (cluster.nodes, cluster.rollout_fraction)"
        )
    samples = algo.batch_size * algo.group_size
    if samples < dp:
        raise LayoutError(
            f"algo.batch_size={algo.batch_size} x algo.group_size={algo.group_size} = {samples} samples per "
            f"step cannot feed {dp} data-parallel ranks: raise algo.batch_size or lower cluster.nodes"
        )
    return cluster.gpus_per_node, first, tp, pp, dp


def _check_ports(plan: AllocationPlan, loopback: bool) -> None:
    # On the first trainer node: controller (2 ports), weight-sync store, trainer master.
    named = {
        "rollout.controller_port": plan.controller_port,
        "rollout.controller_port+1": plan.controller_port + 1,
        "weight_sync.master_port": plan.weight_sync_port,
        "cluster.master_port": plan.trainer_master_port,
    }
    # Server i uses base + i; with loopback every server shares the trainer's host.
    if loopback:
        for index in range(plan.num_servers):
            named[f"rollout.base_port+{index}"] = plan.server_base_port + index
        for index in range(plan.num_reward_servers):
            named[f"reward.model.base_port+{index}"] = plan.reward_base_port + index
    last = plan.server_base_port + plan.num_servers - 1
    if last > 65535:
        raise ValueError(
            f"rollout.base_port={plan.server_base_port} + {plan.num_servers} servers exceeds 65535"
        )
    seen: dict[int, str] = {}
    for name, port in named.items():
        if port in seen:
            raise ValueError(f"{name} and {seen[port]} are both port {port}: change one of them")
        seen[port] = name


def plan_allocation(
    *,
    cluster: ClusterConfig,
    rollout: RolloutConfig,
    trainer: TrainerConfig,
    algo: AlgoConfig,
    weight_sync: WeightSyncConfig,
    reward: RewardConfig | None = None,
) -> AllocationPlan:
    """Decide the layout of the heterogeneous job, or raise ValueError naming the override.
    Reward-model nodes (cluster.reward_nodes / reward_fraction) are set aside first; the rollout
    fraction splits the nodes left."""
    reward_nodes, reward_per_node = _reward_layout(cluster, reward)
    servers_per_node = _servers_per_node(cluster, rollout)
    if reward_nodes:
        # the rest is split in whole nodes too: the reward servers make it a heterogeneous job
        cluster = dataclasses.replace(
            cluster,
            nodes=cluster.nodes - reward_nodes,
            reward_nodes=0,
            reward_fraction=0.0,
            placement=Placement.nodes,
        )
    split = split_gpus(cluster, rollout.tp_size)
    tasks_per_node, first_tasks, tp, pp, dp = _trainer_layout(cluster, trainer, algo, split)
    if trainer.backend is TrainerBackend.torch:
        tasks_per_node = 1
    plan = AllocationPlan(
        gpus_per_node=cluster.gpus_per_node,
        rollout_nodes=split.rollout_nodes,
        servers_per_node=servers_per_node,
        rollout_tp=rollout.tp_size,
        trainer_nodes=split.trainer_nodes,
        trainer_tasks_per_node=tasks_per_node,
        trainer_tp=tp,
        trainer_pp=pp,
        trainer_dp=dp,
        server_base_port=rollout.base_port or DEFAULT_SERVER_BASE_PORT,
        controller_port=rollout.controller_port or DEFAULT_CONTROLLER_PORT,
        weight_sync_port=weight_sync.master_port or DEFAULT_WEIGHT_SYNC_PORT,
        trainer_master_port=cluster.master_port,
        rollout_fraction=cluster.rollout_share,
        placement=split.placement,
        shared_rollout_gpus=split.shared_rollout_gpus,
        trainer_first_gpu=split.trainer_first_gpu,
        trainer_tasks_first_node=first_tasks,
        reward_nodes=reward_nodes,
        reward_servers_per_node=reward_per_node,
        reward_tp=reward.model.tp_size if reward is not None else 1,
        reward_base_port=(reward.model.base_port if reward is not None else 0) or DEFAULT_REWARD_BASE_PORT,
        trainer_ep=trainer.ep_size,
        trainer_etp=trainer.expert_tp_size,
    )
    _check_ports(plan, cluster.loopback)
    return plan


def _reward_layout(cluster: ClusterConfig, reward: RewardConfig | None) -> tuple[int, int]:
    """(reward-model nodes, servers per node), or a LayoutError naming the override."""
    nodes = cluster.reward_share_nodes()
    serves_model = reward is not None and reward.source is not RewardSource.verifier
    if not nodes:
        if serves_model:
            raise LayoutError(
                f"reward.source={reward.source.value} serves a reward model, but the job has no reward-model "
                "nodes: set cluster.reward_nodes=N (or cluster.reward_fraction) for the third component"
            )
        return 0, 0
    if not serves_model:
        raise LayoutError(
            "cluster.reward_nodes / cluster.reward_fraction ask for reward-model nodes, but reward.source=verifier "
            "serves no model: set reward.source=model|combined and reward.model.path, or drop them"
        )
    if cluster.placement not in (Placement.nodes, Placement.auto):
        raise LayoutError(
            f"reward-model nodes are a component of the heterogeneous job: cluster.placement=nodes, not "
            f"{cluster.placement.value}"
        )
    if cluster.rollout_fraction_auto:
        raise LayoutError(
            "cluster.rollout_fraction=auto does not simulate reward-model nodes: set a number, "
            "e.g. cluster.rollout_fraction=0.75 (of the nodes the reward model leaves)"
        )
    tp, gpus = reward.model.tp_size, cluster.gpus_per_node
    if tp > gpus or gpus % tp:
        raise LayoutError(
            f"reward.model.tp_size={tp} must divide cluster.gpus_per_node={gpus} (a server does not span nodes)"
        )
    return nodes, gpus // tp


def plan_job(job: JobConfig) -> AllocationPlan:
    """The plan for a fixed `cluster.rollout_fraction` (`auto` is resolved first by
    launch.planning.layout.allocation.resolve_auto_fraction, which asks this planner which splits are valid)."""
    if job.cluster.rollout_fraction_auto:
        raise ValueError(
            "cluster.rollout_fraction=auto: resolve it first (launch.planning.layout.allocation.resolve_auto_fraction)"
        )
    return plan_allocation(
        cluster=job.cluster,
        rollout=job.rollout,
        trainer=job.trainer,
        algo=job.algo,
        weight_sync=job.weight_sync,
        reward=job.reward,
    )


def apply_plan(job: JobConfig, plan: AllocationPlan) -> JobConfig:
    """The config every role reads: server count, derived DP, the fixed ports and, where servers
    and trainer ranks share GPUs (colocated), each one's share of their memory written in."""
    replace = dataclasses.replace
    base = colocated_schedule(job) if plan.placement is Placement.colocated else job
    planned = replace(
        base,
        rollout=replace(
            base.rollout,
            num_servers=plan.num_servers,
            base_port=plan.server_base_port,
            controller_port=plan.controller_port,
        ),
        trainer=replace(
            base.trainer, tp_size=plan.trainer_tp, pp_size=plan.trainer_pp, dp_size=plan.trainer_dp
        ),
        weight_sync=replace(base.weight_sync, master_port=plan.weight_sync_port),
        cluster=replace(base.cluster, rollout_fraction=repr(plan.rollout_fraction)),
    )
    if plan.reward_nodes:
        model = replace(
            planned.reward.model, num_servers=plan.num_reward_servers, base_port=plan.reward_base_port
        )
        planned = replace(planned, reward=replace(planned.reward, model=model))
    shared = plan.placement is Placement.colocated  # a server and a trainer rank on every GPU
    return apply_shares(planned, shares_for(planned, int(shared), int(shared)))
