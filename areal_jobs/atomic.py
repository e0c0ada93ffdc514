"""Files other processes read while they are written: a reader sees the old content or the new,
never half of it (POSIX rename within one directory is atomic).

Every writer of a file that another process polls (server registrations, checkpoint pointers,
controller snapshots, test orders) goes through `write_atomic`.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

_COUNTER = itertools.count()  # next() is atomic under the GIL


def write_atomic(path: str | os.PathLike, data: bytes | str, durable: bool = False) -> None:
    """Write `data` to `path` through a temporary file in the same directory, then rename it over
    `path`. The temporary name is this writer's own (pid, thread and a counter), so concurrent
    writers of one path never share it (the last rename wins); it is created with the mode any
    new file gets (0666 less the umask), as a plain write would. `durable`: fsync before the
    rename, for files a crash must not empty (controller snapshots: the rename can reach the disk
    before the data otherwise)."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_COUNTER)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
