"""Test-only fault injection: kill -9 a rollout server in the middle of a weight broadcast.

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
                async def call(tensors, group_name, v):
                    calls.append(v)
                    if len(calls) == order["at_bucket"]:
                        os.killpg(order["pid"], signal.SIGKILL)
                        Path(ARM + ".fired").write_text(
                            json.dumps({"version": version, "bucket": len(calls)})
                        )
                    return await send(tensors, group_name, v)

                return call

            # this client only, this update; a plain bucket or an encoded one (weight_sync.sync=delta)
            client.update_weights_from_distributed = dies_at_bucket(client.update_weights_from_distributed)
            client.receive_encoded_bucket = dies_at_bucket(client.receive_encoded_bucket)
        return await _receive(self, version, senders)

    weight_update.WeightUpdateOrchestrator.receive = _receive_with_fault
