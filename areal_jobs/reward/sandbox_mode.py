"""Which isolation mode the code sandbox runs in, and the refusal to run without a strong one.

Strong modes (docs/sandbox.md), both built by `unshare(1)` (util-linux, on every Linux host) plus
sandbox_boot.py: new network, PID and mount namespaces, a private size-capped tmpfs root holding
only the program, the read-only interpreter and /usr, no host /dev/shm or /tmp, rlimits, wall
timeout, and everything killed with the PID namespace.
- netns: needs root; programs run as a per-service sandbox uid (sandbox_uids.py).
- userns: any user on a kernel that allows unprivileged user namespaces (the default of Debian,
  Ubuntu, RHEL 8+ and SLES); the namespaces are created inside a new user namespace in which the
  caller's uid is mapped to 0 (`--map-root-user`); the boot script drops every capability before
  the program runs, so the program has no privilege there either.
- none (weak): rlimits, scrubbed environment and process-group kill only. Never chosen silently:
  `auto` raises when no strong mode works, naming the override.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess

from areal_jobs.config import NetworkIsolation

logger = logging.getLogger(__name__)

NAMESPACE_ARGS = ("--net", "--pid", "--mount", "--fork", "--kill-child")
USERNS_ARGS = ("--user", "--map-root-user", *NAMESPACE_ARGS)
STRONG_MODES = (NetworkIsolation.netns, NetworkIsolation.userns)  # strongest first
_PROBE_TIMEOUT_S = 10
_NOBODY = 65534  # root probes userns as an unprivileged uid: the sandbox never runs it as root


def unshare_argv(mode: NetworkIsolation) -> list[str]:
    """The command prefix that puts a program into `mode`'s namespaces ([] for none)."""
    if mode is NetworkIsolation.none:
        return []
    args = NAMESPACE_ARGS if mode is NetworkIsolation.netns else USERNS_ARGS
    return [shutil.which("unshare") or "unshare", *args]


@functools.cache
def unavailable_reason(mode: NetworkIsolation) -> str | None:
    """None when `mode` works for this process, else why not (probed once per process)."""
    if mode is NetworkIsolation.none:
        return None
    if mode is NetworkIsolation.auto:
        raise ValueError("probe a concrete mode, not auto")
    if shutil.which("unshare") is None:
        return "unshare(1) not found on PATH (util-linux)"
    if mode is NetworkIsolation.netns and os.geteuid() != 0:
        return "netns needs root"
    drop = {}
    if mode is NetworkIsolation.userns and os.geteuid() == 0:
        drop = {"user": _NOBODY, "group": _NOBODY, "extra_groups": []}
    try:
        probe = subprocess.run(
            [*unshare_argv(mode), "true"], check=False, capture_output=True, timeout=_PROBE_TIMEOUT_S, **drop
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"unshare probe failed: {e}"
    if probe.returncode != 0:
        return (
            f"unshare probe exited {probe.returncode}: {probe.stderr.decode(errors='replace').strip()[:200]}"
        )
    return None


def resolve_isolation(requested: NetworkIsolation) -> NetworkIsolation:
    """The mode in force for `requested`. Raises RuntimeError, naming reward.network_isolation,
    when a required strong mode (or, for auto, every strong mode) is unavailable."""
    if requested is NetworkIsolation.none:
        _warn_weak()
        return requested
    candidates = STRONG_MODES if requested is NetworkIsolation.auto else (requested,)
    reasons = {}
    for mode in candidates:
        reason = unavailable_reason(mode)
        if reason is None:
            return mode
        reasons[mode.value] = reason
    why = "; ".join(f"{mode}: {reason}" for mode, reason in reasons.items())
    # a strong mode the caller did not ask for may work here (netns as non-root: userns does)
    working = [m for m in STRONG_MODES if m not in candidates and unavailable_reason(m) is None]
    if working:
        strong = working[0].value
        raise RuntimeError(
            f"reward.network_isolation={requested.value} is not available here ({why}); set "
            f"reward.network_isolation={strong} (or auto), a strong mode that works here: the same "
            "network, PID and mount namespaces and private root (docs/sandbox.md). "
            "reward.network_isolation=none would accept the weak sandbox"
        )
    # The override comes first: callers may cut the message short.
    raise RuntimeError(
        f"reward.network_isolation={requested.value}: no strong code sandbox works here, refusing to "
        "run untrusted code; set reward.network_isolation=none to accept the weak sandbox (no "
        f"network, PID or file-system isolation: docs/sandbox.md). Why: {why}. To fix the host: run "
        "as root, or allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
        "kernel.unprivileged_userns_clone=1, no AppArmor userns restriction)"
    )


@functools.cache
def _warn_weak() -> None:
    logger.warning(
        "reward.network_isolation=none: the weak code sandbox. Programs keep network access, see "
        "the host file system with their uid's rights (/tmp, /dev/shm), and as non-root a daemon "
        "that leaves the process group outlives its run. Rlimits, the scrubbed environment and the "
        "process-group kill still apply. See docs/sandbox.md."
    )
