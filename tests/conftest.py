"""Fixtures shared by unit and integration tests, and the guard that keeps them from leaking.

Process-wide state (os.environ, the working directory, signal handlers, the root logger, torch's
thread count) must look the same after every test as when the session started: a fixture or test
that changes it for everyone else fails, once, at the teardown of the first test that shows it.
Session fixtures keep what they start in their own objects (the SLURM cluster's `env`, a server's
address) and hand it to tests that ask; `monkeypatch` scopes a change to one test.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD)
# Set by libraries the first time they are imported (cache locations, the same for every test):
# torch._inductor (imported by transformers' models and Megatron-Core), SGLang; scikit-learn's
# OpenMP workarounds (transformers' generation utils import it wherever it is installed, as on the
# GPU machines' image).
LIBRARY_ENV = {
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "CUDA_CACHE_PATH",
    "FLASHINFER_WORKSPACE_BASE",
    "TILELANG_CACHE_DIR",
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
    # torch._inductor's first compile (trainer.compile: tests/unit/trainer/test_trainer_compile.py)
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
}
# Changed on purpose by a fixture wider than one test, which restores it itself.
FIXTURE_ENV = {
    # test_reward_adversarial.py `outcome` (module): reward workers, spawned and respawned during the
    # module, must inherit a secret the sandboxed attacks then try to read
    "AREAL_PLANTED_SECRET",
}
_baseline: dict[str, object] = {}


# Two workers share CI's two cores (`make test`: pytest-xdist, --dist loadgroup). Tests that share
# something expensive or exclusive run on one worker, in one group: the SLURM cluster (one per
# run), the SGLang session server, the reward sandbox pools, the bench's model and run dirs, the
# vLLM servers (their CPU KV caches are large), the pretrained checkpoint. Every other module is
# its own group, so its module-scoped fixtures start once. The longest groups go first.
SHARED_GROUPS = {
    "tests/integration/slurm/": "slurm",
    "tests/integration/sglang/": "sglang",
    "tests/integration/reward/": "reward",
    "tests/integration/bench/": "bench",
    "tests/integration/vllm/": "vllm",
    "tests/integration/pretrained/": "pretrained",
}
# the two longest groups first, one per worker (xdist hands the first group to the first worker,
# the second to the second; `make test` passes --no-loadscope-reorder, or xdist would order the
# groups by their number of tests): measured with the groups in effect, vLLM ~900 s and SLURM
# ~740 s of test time, so neither is left to start last and run alone at the end
_FIRST = (
    "tests/integration/vllm/",
    "tests/integration/slurm/",
    "tests/integration/e2e/",
    "tests/integration/bench/",
    "tests/integration/",
)


def xdist_group_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((group for prefix, group in SHARED_GROUPS.items() if path.startswith(prefix)), path)


# tryfirst: xdist's own hook (--dist loadgroup) turns each item's xdist_group marker into the
# "@group" suffix of its node id, which is what the scheduler reads; run after it, the markers added
# here were never seen and every test was its own group (a module's tests split over both workers,
# its module fixtures built twice)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(xdist_group_of(item.nodeid)))
    rank = {
        id(item): next((i for i, p in enumerate(_FIRST) if item.nodeid.startswith(p)), len(_FIRST))
        for item in items
    }
    items.sort(key=lambda item: rank[id(item)])  # stable: the order inside a rank is pytest's


def process_state() -> dict[str, object]:
    root = logging.getLogger()
    torch = sys.modules.get("torch")
    return {
        "os.environ": {
            k: v
            for k, v in os.environ.items()
            if k != "PYTEST_CURRENT_TEST" and k not in LIBRARY_ENV | FIXTURE_ENV
        },
        "cwd": os.getcwd(),
        "signal handlers": {sig.name: signal.getsignal(sig) for sig in _SIGNALS},
        "root logger": (
            logging.getLevelName(root.level),
            [h for h in root.handlers if not type(h).__module__.startswith("_pytest")],
        ),
        "torch threads": torch.get_num_threads() if torch is not None else None,
    }


def describe_changes(before: dict[str, object], after: dict[str, object]) -> list[str]:
    changes = []
    env_before, env_after = before["os.environ"], after["os.environ"]
    for key in sorted(set(env_before) | set(env_after)):
        if env_before.get(key) != env_after.get(key):
            how = "set" if key not in env_before else "removed" if key not in env_after else "changed"
            changes.append(f"os.environ[{key!r}] {how}")
    for sig in _SIGNALS:
        if before["signal handlers"][sig.name] != after["signal handlers"][sig.name]:
            changes.append(
                f"{sig.name} handler: {before['signal handlers'][sig.name]!r} -> {after['signal handlers'][sig.name]!r}"
            )
    for name in ("cwd", "root logger", "torch threads"):
        if name == "torch threads" and before[name] is None:
            continue  # torch imported during this test: its default is not a change
        if before[name] != after[name]:
            changes.append(f"{name}: {before[name]!r} -> {after[name]!r}")
    return changes


@pytest.fixture(scope="session", autouse=True)
def _process_state_at_start() -> None:
    """Set up before any other session fixture, so the baseline is the untouched process."""
    _baseline.update(process_state())


@pytest.fixture(autouse=True)
def no_leaked_process_state() -> None:
    yield
    now = process_state()
    changes = describe_changes(_baseline, now)
    _baseline.update(now)  # only the first test that shows a leak fails, not every one after it
    if changes:
        pytest.fail(
            "process-wide state changed and not restored (by this test or a fixture it uses; "
            "use monkeypatch, or keep the state in the fixture's own object): " + "; ".join(changes),
            pytrace=False,
        )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The built-in tokenizer and a randomly initialised tiny Qwen2 (no warm start): seconds to build."""
    import torch

    from areal_jobs.tasks.warm_start.tiny_model import TinyRecipe, build_builtin_model

    threads = torch.get_num_threads()  # the build sets torch's thread count and seeds its RNG
    try:
        with torch.random.fork_rng(devices=[]):
            return build_builtin_model(
                tmp_path_factory.mktemp("tiny-model"), TinyRecipe(sft_steps=0), threads=1
            )
    finally:
        torch.set_num_threads(threads)
