"""Files other processes read while they are written: a reader sees the old content or the new,
never half of it (POSIX rename within one directory is atomic).

Every writer of a file that another process polls (server registrations, checkpoint pointers,
controller snapshots, test orders) goes through `write_atomic`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes | str, durable: bool = False) -> None:
    """Write `data` to `path` through a temporary file in the same directory, then rename it over
    `path`. The temporary name is unique, so concurrent writers of one path never share it (the
    last rename wins). `durable`: fsync before the rename, for files a crash must not empty
    (controller snapshots: the rename can reach the disk before the data otherwise)."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
