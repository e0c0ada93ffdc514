"""Test-only fault injection: kill -9 a rollout server in the middle of a weight broadcast, or stall
(SIGSTOP) a server or the trainer inside an update (below).

Python's `site` imports this module in every process whose PYTHONPATH starts with this folder
(tests/integration/e2e/test_e2e_faults.py puts it there for one launch.local run); it acts only
in the controller, and only once the test has armed it by writing the file named by
AREAL_TEST_KILL_IN_UPDATE: {"server": index, "pid": its process group, "at_bucket": n}. The next
update then kills that server's process group just before sending it bucket n, when the trainer
is broadcasting and the other servers are receiving: the window no outside timing can hit reliably.
Production code has no hook for this; what is patched is the controller's own call to the server.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

ARM = os.environ.get("AREAL_TEST_KILL_IN_UPDATE", "")


def _announce(arm: str, payload: str) -> None:
    """Write `<arm>.fired` atomically: the test reads it the moment it exists."""
    tmp = Path(arm + ".fired.tmp")
    tmp.write_text(payload)
    tmp.replace(arm + ".fired")


def _in_controller() -> bool:
    try:
        return b"areal_jobs.rollout.main" in Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return False


if ARM and _in_controller():
    from areal_jobs.rollout import weight_update

    _receive = weight_update.WeightUpdateOrchestrator.receive

    async def _receive_with_fault(self, version, senders):
        armed = Path(ARM)
        if armed.exists():
            order = json.loads(armed.read_text())
            armed.unlink()
            client = self.pool.slots[order["server"]].client
            calls = []

            def dies_at_bucket(send):
                async def call(tensors, group_name, v, **kwargs):
                    calls.append(v)
                    if len(calls) == order["at_bucket"]:
                        os.killpg(order["pid"], signal.SIGKILL)
                        _announce(ARM, json.dumps({"version": version, "bucket": len(calls)}))
                    return await send(tensors, group_name, v, **kwargs)

                return call

            # this client only, this update; a plain bucket or an encoded one (weight_sync.sync=delta)
            client.update_weights_from_distributed = dies_at_bucket(client.update_weights_from_distributed)
            client.receive_encoded_bucket = dies_at_bucket(client.receive_encoded_bucket)
        return await _receive(self, version, senders)

    weight_update.WeightUpdateOrchestrator.receive = _receive_with_fault


# ---------------------------------------------------------------- stalls (test_e2e_starved.py)
# Two more armed faults, each fired once, each a SIGSTOP the test ends with SIGCONT:
# AREAL_TEST_STALL_SERVER_IN_UPDATE (controller): {"pid": a server's process group}: the next update
#   stops that server just before begin_weight_update, so the stage's calls go unanswered;
# AREAL_TEST_STALL_TRAINER_IN_BROADCAST (trainer): {"after_version": v}: the first broadcast of a
#   version above v stops the trainer just before its first bucket, while the servers wait for it
#   inside the collective. The test arms it while the run cannot reach that broadcast yet (a
#   server is stopped), so the run can never finish before the stall fires: arming after the
#   fact raced the run's last steps (CI: 12 steps in 6 s once the starvation ended, the stall
#   never fired).
STALL_SERVER = os.environ.get("AREAL_TEST_STALL_SERVER_IN_UPDATE", "")
STALL_TRAINER = os.environ.get("AREAL_TEST_STALL_TRAINER_IN_BROADCAST", "")


def _take(arm: str) -> dict | None:
    armed = Path(arm)
    if not armed.exists():
        return None
    order = json.loads(armed.read_text())
    armed.unlink()
    return order


if STALL_SERVER and _in_controller():
    from areal_jobs.rollout import weight_update as _wu

    _receive_buckets = _wu.WeightUpdateOrchestrator._receive_buckets

    async def _receive_buckets_with_stall(self, version, senders):
        order = _take(STALL_SERVER)
        if order is not None:
            os.killpg(order["pid"], signal.SIGSTOP)
            _announce(STALL_SERVER, json.dumps({"version": version}))
        return await _receive_buckets(self, version, senders)

    _wu.WeightUpdateOrchestrator._receive_buckets = _receive_buckets_with_stall


def _in_trainer() -> bool:
    try:
        return b"areal_jobs.trainer.main" in Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return False


if STALL_TRAINER and _in_trainer():
    import re

    from areal_jobs.weights import broadcast as _broadcast

    # every bucket, flat or encoded (weight_sync.sync=delta), goes out through broadcast()
    _broadcast_flat = _broadcast.WeightBroadcastGroup.broadcast

    def _broadcast_with_stall(self, tensor, stage):
        found = re.search(r"\(version (\d+)\)", stage)
        armed = Path(STALL_TRAINER)
        if found and armed.exists():
            after = json.loads(armed.read_text()).get("after_version", -1)
            if int(found.group(1)) > after and _take(STALL_TRAINER) is not None:
                _announce(STALL_TRAINER, json.dumps({"stage": stage}))
                os.kill(os.getpid(), signal.SIGSTOP)  # the test sends SIGCONT
        return _broadcast_flat(self, tensor, stage)

    _broadcast.WeightBroadcastGroup.broadcast = _broadcast_with_stall
