"""Control calls between the job's processes: how long they may take, and how they are repeated.

Every control call of the job is classified in docs/faults.md ("Control calls"): calls that are
safe to repeat are repeated with exponential backoff and jitter until their deadline
(areal_jobs/transport/retry.py); the first attempt of each waits `rollout.call_timeout_s` (server
calls) or `weight_sync.step_timeout_s` (weight-update stages), and every repeat twice as long as the
one before. A deadline is never shorter than 20 round trips of the same call as recently measured,
so it grows with how slow the machine is. Only a real failure ends a run: a refused connection
(the server process is gone), a wrong request, or a deadline spent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ControlConfig:
    """Deadlines and backoff of repeated control calls (docs/faults.md, "Control calls")."""

    # all attempts of one repeatable server control call together: pause, resume, abort, flush,
    # weight version, begin/end of a weight update, group teardown, memory release
    call_deadline_s: float = 600.0
    # loading weights from disk or a LoRA adapter, all attempts (a slow file system)
    load_deadline_s: float = 1800.0
    # one weight update, its repeats included: a stage that times out while every server still
    # answers is sent again (same version, fresh groups) with doubled stage timeouts until this
    update_deadline_s: float = 1800.0
    # a starting server is waited for while it makes progress (CPU, log), for at most this long;
    # without progress for rollout.server_start_timeout_s it is given up on sooner
    server_start_deadline_s: float = 3600.0
    # a server whose health probes keep failing (timeouts, not a refused connection) for this long
    # is marked down; a refused connection marks it down at once
    health_grace_s: float = 60.0
    # the trainer waits for a controller reply as long as the controller keeps talking (it sends
    # stats every 2 s): it gives up after this long without any message, or at the wait's deadline
    peer_silence_s: float = 300.0
    backoff_s: float = 0.5  # pause before the first repeat (uniform in [0, this]); doubles per repeat
    max_backoff_s: float = 30.0  # the longest pause between repeats

    def __post_init__(self) -> None:
        for name in (
            "call_deadline_s",
            "load_deadline_s",
            "update_deadline_s",
            "health_grace_s",
            "peer_silence_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"control.{name} must be > 0 (seconds), e.g. control.{name}=600")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(
                "control.backoff_s must be >= 0 and control.max_backoff_s >= control.backoff_s "
                "(e.g. control.backoff_s=0.5 control.max_backoff_s=30)"
            )
