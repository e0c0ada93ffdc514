"""The in-child half of the sandbox: trusted code that runs between "process created" and "untrusted
program starts", then replaces itself with the program (execve).

Run by reward/sandbox.py as `python -I -S sandbox_boot.py key=value ...`, either directly (weak
mode `none`) or as PID 1 of fresh network + PID + mount namespaces created by `unshare(1)` (netns
as root; userns inside a new user namespace, where we are uid 0 with capabilities over these
namespaces only).
It imports only the standard library and never imports areal_jobs: it is executed by path, with
`-I` so nothing from the working directory or the environment can shadow a module. Its arguments
are plain key=value strings, not JSON: importing json (re, enum) would double its start-up time,
and it runs once per program.

Steps, in this order because each needs the privileges the next one drops:
1. (namespace modes) build a minimal root file system in a size-capped tmpfs (the program's files,
   /usr and the interpreter bound read-only, a few /dev nodes, a fresh /proc), make it the root
   with pivot_root and detach the host's whole mount tree: no host path exists any more in this
   mount namespace, so no chroot escape can reach one; see _isolate_filesystem. Binding the interpreter also makes it reachable when it lives under a
   0700 home such as /root/.pyenv, which the sandbox uid could not traverse on the host.
2. Set resource limits (soft = hard, so the program cannot raise them).
3. Drop to the sandbox uid/gid with no supplementary groups (netns, none as root), or in userns
   drop every capability (bounding, ambient, inheritable, permitted, effective: the program then
   has none even as uid 0 of its user namespace); set no_new_privs so setuid binaries grant
   nothing; ask for SIGKILL when our parent dies (set after setuid, which clears it).
4. Write "R" to the ready fd (close-on-exec) and execve the interpreter on main.py with `-I -S`
   (standard library only); if the exec fails, write "X". From a successful exec on, any failure
   is the program's, not the sandbox's. In namespace mode the init then appends "W<wait status>".
Any failure exits with BOOT_FAILED and a one-line reason on stderr.
"""

import ctypes
import os
import resource
import stat
import sys

BOOT_FAILED = 125

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC = 32, 4096, 16384
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 1, 24, 38, 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAP_VERSION_3 = 0x20080522
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203}
_DEVICES = {"null": 3, "zero": 5, "random": 8, "urandom": 9}  # minor numbers of the "mem" char devices
_SYSTEM_DIRS = ("usr", "bin", "lib", "lib64", "lib32")  # shared libraries and the ELF loader live here
_LIBC = ctypes.CDLL(None, use_errno=True)


def _fail(reason: str) -> None:
    os.write(2, f"sandbox-boot: {reason}\n".encode())
    os._exit(BOOT_FAILED)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    if _LIBC.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _isolate_filesystem(spec: dict) -> tuple[str, str]:
    """Step 1: build the program's whole file system in a fresh tmpfs and chroot into it.

    /work   the program's files; its cwd, HOME and TMPDIR; writable by the sandbox uid only
    /tmp    world-writable scratch (some programs hard-code it)
    /usr (and the /bin, /lib, /lib64 links or dirs)  system binaries and libraries, read-only
    <prefix>  the interpreter's installation at its own path (its RUNPATH may be absolute), read-only
    /dev    null, zero, random, urandom
    /proc   a procfs of the new PID namespace: the program sees its own processes only
    No /etc, no /home, no /root, no data: the program can neither write outside its sandbox nor
    read host files (data sets with answer keys, credentials, other users' files). Everything
    outside is also remounted read-only, in case the chroot is ever escaped.
    Returns (interpreter path, working directory), both inside the new root.
    """
    root = spec["workdir"]
    # the root we build must be traversable by the sandbox uid whatever umask the run works under
    # (launch.local and the SLURM job use 077 for the run directory): parents of bind targets too
    os.umask(0o022)
    files = {}
    for name in os.listdir(root):
        with open(os.path.join(root, name), "rb") as f:
            files[name] = f.read()
    uid = spec["uid"] if spec["uid"] >= 0 else os.getuid()
    gid = spec["gid"] if spec["gid"] >= 0 else os.getgid()
    # The size cap bounds how much disk (RAM) the program can fill, whatever it writes.
    # Not nodev: the four device nodes below live on it. The program cannot add any (no CAP_MKNOD).
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID, f"size={spec['tmpfs_mb']}m,mode=0755")
    for name, mode in (("work", 0o700), ("tmp", 0o1777), ("dev", 0o755), ("proc", 0o555)):
        os.mkdir(os.path.join(root, name))
        os.chmod(os.path.join(root, name), mode)  # mkdir's mode is masked by the umask
    os.chown(os.path.join(root, "work"), uid, gid)
    for name, data in files.items():
        path = os.path.join(root, "work", name)
        with open(path, "wb") as f:
            f.write(data)
        os.chown(path, uid, gid)
    read_only = _MS_RDONLY | _MS_NOSUID | _MS_NODEV
    for name in _SYSTEM_DIRS:
        host = "/" + name
        if os.path.islink(host):  # merged /usr: /lib -> usr/lib
            os.symlink(os.readlink(host), os.path.join(root, name))
        elif os.path.isdir(host):
            _bind(host, os.path.join(root, name), read_only)
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(sys.executable)
    if not any(prefix == f"/{d}" or prefix.startswith(f"/{d}/") for d in _SYSTEM_DIRS):
        _bind(prefix, root + prefix, read_only)
    for dev, minor in _DEVICES.items():
        target = os.path.join(root, "dev", dev)
        try:  # a node, not a bind mount, where we may: every mount costs at teardown
            os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
            os.chmod(target, 0o666)
        except PermissionError:  # userns: no CAP_MKNOD over the host's devices; bind the host's node
            open(target, "wb").close()
            _mount("/dev/" + dev, target, None, _MS_BIND, None)
    _mount("proc", os.path.join(root, "proc"), "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
    _pivot_root(root)
    return exe, "/work"


def _pivot_root(root: str) -> None:
    """Make `root` (a mount point: our tmpfs) the root of this mount namespace and detach the old
    root with every mount under it. unshare(1) made all mounts private, which pivot_root needs."""
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: unknown syscall number on {os.uname().machine}")
    os.chdir(root)
    os.mkdir(".old_root", 0o700)
    if _LIBC.syscall(number, b".", b".old_root") != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root {root}: {os.strerror(err)}")
    os.chroot(".")
    os.chdir("/")
    if _LIBC.umount2(b"/.old_root", _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount old root: {os.strerror(err)}")
    os.rmdir("/.old_root")


def _bind(source: str, target: str, flags: int) -> None:
    """Bind `source` on `target` (created, with 0755 parents, in our tmpfs), then apply `flags`
    (a bind mount ignores them on creation), keeping the source's nosuid/nodev/noexec: in a user
    namespace those are locked, and a remount that would clear one fails."""
    if not os.path.exists(target):
        os.makedirs(target, mode=0o755)
    _mount(source, target, None, _MS_BIND | _MS_REC, None)
    locked = os.statvfs(source).f_flag & (_MS_NOSUID | _MS_NODEV | _MS_NOEXEC)  # ST_* == MS_* here
    _mount(None, target, None, _MS_REMOUNT | _MS_BIND | flags | locked, None)


def _drop_privileges(spec: dict) -> None:
    """Steps 2-3."""
    for name, value in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))  # [soft, hard]
    if spec["uid"] >= 0 and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
    if spec["drop_caps"]:
        _drop_capabilities()
    if _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail("prctl(PR_SET_NO_NEW_PRIVS) failed")
    _LIBC.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)


def _drop_capabilities() -> None:
    """userns: we stay uid 0 of our user namespace, so empty every capability set; with the
    bounding and inheritable sets empty, exec grants none back either."""
    cap = 0
    while _LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # EINVAL past the last capability
        cap += 1
    if cap == 0:
        _fail("prctl(PR_CAPBSET_DROP) failed")
    _LIBC.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} structs, all zero
    if _LIBC.capset(header, data) != 0:
        _fail(f"capset: {os.strerror(ctypes.get_errno())}")


def _run_as_init(child_pid: int, status_fd: int) -> None:
    """PID 1 of the namespace: reap every process until the program exits, then report its wait
    status on `status_fd` and exit, which makes the kernel kill whatever the program left behind.
    The program is not PID 1 itself because PID 1 ignores signals it has no handler for, even the
    kernel's SIGXCPU for the CPU limit."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(BOOT_FAILED)
        if pid == child_pid:
            os.write(status_fd, f"W{status}".encode())
            os._exit(0)


def parse_args(argv: list[str]) -> dict:
    """key=value strings -> spec; see reward/sandbox.py for the writer."""
    raw = dict(arg.split("=", 1) for arg in argv)
    return {
        "workdir": raw["workdir"],
        "script": raw["script"],
        "uid": int(raw["uid"]),
        "gid": int(raw["gid"]),
        "isolate_fs": raw["isolate_fs"] == "1",
        "drop_caps": raw["drop_caps"] == "1",
        "tmpfs_mb": int(raw["tmpfs_mb"]),
        "ready_fd": int(raw["ready_fd"]),
        "rlimits": {
            k[len("rlimit.") :]: [int(v) for v in raw[k].split(",")] for k in raw if k.startswith("rlimit.")
        },
    }


def main() -> None:
    spec = parse_args(sys.argv[1:])
    ready_fd = spec["ready_fd"]
    try:
        if spec["isolate_fs"]:
            python, cwd = _isolate_filesystem(spec)
        else:
            python, cwd = os.path.realpath(sys.executable), spec["workdir"]
        if spec["isolate_fs"]:
            child = os.fork()
            if child:
                _run_as_init(child, ready_fd)
        _drop_privileges(spec)
        os.chdir(cwd)
    except Exception as e:  # noqa: BLE001  anything here is a sandbox failure, reported as one
        _fail(f"{type(e).__name__}: {e}")
    if not os.access(python, os.X_OK):
        _fail(f"uid {os.getuid()} cannot execute {python}: set reward.code_python to a readable interpreter")
    # Close-on-exec: a successful exec closes it, so the program never holds it; a failed exec
    # (a resource limit, an unreadable interpreter) can still say so, and is then reported as a
    # sandbox failure rather than as a failed program.
    os.set_inheritable(ready_fd, False)
    os.write(ready_fd, b"R")
    try:
        os.execv(python, [python, "-I", "-S", spec["script"]])
    except OSError as e:
        os.write(ready_fd, b"X")
        _fail(f"exec {python}: {e}")


if __name__ == "__main__":
    main()
