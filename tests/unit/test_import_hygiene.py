"""The pure core imports no GPU stack: every decision module loads with sglang, megatron and
torch.cuda users absent (STYLE P5). Checked in a fresh interpreter where they cannot be imported."""

import subprocess
import sys

PURE_MODULES = [
    "areal_jobs.config",
    "areal_jobs.api",
    "areal_jobs.transport.messages",
    "areal_jobs.transport.codec",
    "areal_jobs.transport.channels",
    "areal_jobs.staleness",
    "areal_jobs.rollout.controller",
    "areal_jobs.rollout.server_pool",
    "areal_jobs.rollout.weight_update",
    "areal_jobs.transport.discovery",
    "areal_jobs.rollout.engines",
    "areal_jobs.rollout.vllm_client",
    "areal_jobs.rollout.vllm_server",
    "areal_jobs.rollout.vllm_auth",
    "areal_jobs.trainer.objective.advantages",
    "areal_jobs.trainer.intake.packing",
    "areal_jobs.trainer.intake.batch",
    "areal_jobs.weights.buckets",
    "areal_jobs.tasks.arith_task",
    "areal_jobs.data.prompts",
    "areal_jobs.reward.math_answer",
    "areal_jobs.reward.registry",
    "launch.planning.layout.plan",
    "launch.slurm.render",
]

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'sglang', 'megatron', 'torch', 'transformers', 'transformer_engine'}:
            raise ImportError('blocked heavy import: ' + name)
sys.meta_path.insert(0, Block())
import importlib
for mod in sys.argv[1:]:
    importlib.import_module(mod)
print('ok')
"""


def test_pure_core_imports_without_the_gpu_stack():
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER, *PURE_MODULES], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
