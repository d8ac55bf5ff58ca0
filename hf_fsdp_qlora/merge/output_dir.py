"""Where `merge-adapters` and `convert` may write, and how the finished folder replaces an old one.

Two promises, kept by construction:

- Nothing the user did not ask to replace is ever deleted. Every path is resolved (symlinks, `..`, `~`)
  before it is compared; an output that equals, contains or lies inside an input is refused, and so are
  `""`, the current folder, the home folder and a filesystem root. `force` (`--force`) replaces only a folder this
  tool wrote (it holds :data:`MARKER`, which lists the files written) and that holds nothing else.
- A kill at any instant leaves the old output or the new one complete at `output`. The new folder is
  written beside it under a hidden name and swapped in with one `renameat2(RENAME_EXCHANGE)`; where the
  filesystem lacks that (NFS, some FUSE), two renames are used and the next run restores the old folder
  if a kill fell between them. A run holds a `flock` lock on a file in its hidden folder for as long as
  it writes (per open file, so even a second run in the same process sees it; Linux NFS maps it to a POSIX
  lock the server sees): another run (on any host sharing the filesystem) removes a leftover only when it can take
  that lock, so it never deletes work in progress. A PID alone is ambiguous across hosts.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
from pathlib import Path

from hf_fsdp_qlora.errors import MergeError, MergeUsageError
from hf_fsdp_qlora.safetensors_io import apply_umask_mode

__all__ = ["MARKER", "AtomicOutputDir", "check_output", "resolve_path"]

MARKER = ".hf-fsdp-qlora-output.json"
_LOCK = ".hf-fsdp-qlora-writing.lock"
_PARTIAL, _OLD = ".partial-", ".old-"


def resolve_path(path: str | Path) -> Path:
    """The real absolute path: `~` expanded, symlinks and `..` resolved (the path need not exist)."""
    return Path(os.path.expanduser(str(path))).resolve()


def _listing(folder: Path, names=None) -> str:
    names = sorted(names if names is not None else os.listdir(folder))
    shown = ", ".join(names[:5]) + (f", ... ({len(names)} entries)" if len(names) > 5 else "")
    return shown or "nothing"


def check_output(
    output: str | Path, inputs: list[tuple[str, str | Path]], force: bool, option: str = "`output`"
) -> Path:
    """Refuse an output that would destroy anything but an earlier output of this tool; returns it resolved.

    Args:
        output: the folder to create or replace, as the user typed it.
        inputs: `(option name, path)` of everything the run reads; the output may not overlap any.
        force: whether an existing output may be replaced.

    Raises:
        MergeUsageError: the output is empty, a protected folder, overlaps an input, or may not be replaced.
    """
    raw = str(output)
    if not raw.strip():
        raise MergeUsageError(f"{option} is empty (an unset shell variable?): name a new folder for the result")
    out = resolve_path(raw)
    shown = raw if str(out) == raw else f"{raw} (= {out})"
    if out.parent == out:
        raise MergeUsageError(f"{option} {shown} is a filesystem root: name a new folder for the result")
    for what, folder in (("the current folder", Path.cwd().resolve()), ("your home folder", Path.home().resolve())):
        if out == folder or out in folder.parents:
            verb = "is" if out == folder else "contains"
            raise MergeUsageError(f"{option} {shown} {verb} {what}: name a new folder for the result")
    for name, path in inputs:
        real = resolve_path(path)
        if out == real or out in real.parents or real in out.parents:
            how = "is" if out == real else ("contains" if out in real.parents else "lies inside")
            named = str(path) if str(path) == str(real) else f"{path} (= {real})"
            raise MergeUsageError(
                f"{option} {shown} {how} {name} {named}: nothing was touched; write the result to a folder "
                "outside every input"
            )
    if not os.path.lexists(out):
        return out
    if not force:
        raise MergeUsageError(
            f"{option} {shown} already exists. Pass `force=True` to replace it (the old folder is kept until the new "
            f"one is complete), or choose another {option}."
        )
    if not out.is_dir():
        raise MergeUsageError(f"{option} {shown} is a file, not a folder this tool wrote: `force` leaves it alone")
    present = set(os.listdir(out)) - {_LOCK}
    if not present:
        return out  # an empty folder: nothing to lose
    written = _written_files(out)
    if written is None:
        raise MergeUsageError(
            f"{option} {shown} was not written by merge-adapters or hf-fsdp-qlora convert (no {MARKER} in it) and "
            f"holds {_listing(out, present)}: `force` only replaces an earlier output of this tool. Choose another "
            f"{option}, or remove that folder yourself if you mean to."
        )
    extra = present - written - {MARKER}
    if extra:
        raise MergeUsageError(
            f"{option} {shown} is an earlier output of this tool, but now also holds {_listing(out, extra)}, which "
            f"it did not write: `force` leaves it alone. Move those files out, or choose another {option}."
        )
    return out


def _written_files(folder: Path) -> set[str] | None:
    try:
        marker = json.loads((folder / MARKER).read_text())
        return set(marker["files"]) if isinstance(marker, dict) and isinstance(marker.get("files"), list) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _owner_alive(folder: Path) -> tuple[bool, str]:
    """(whether the run that made `folder` still runs, who it is). No lock file: a finished swap's garbage."""
    lock = folder / _LOCK
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False, ""
    except OSError:
        return True, ""  # cannot tell: keep it
    try:
        who = os.pread(fd, 200, 0).decode(errors="replace").strip()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EAGAIN):
                return True, who
            # No working locks on this filesystem: only a run of this host can be judged, by its pid.
            host, _, pid = who.rpartition(" pid ")
            if host == socket.gethostname() and pid.isdigit():
                return _pid_alive(int(pid)), who
            return True, who
        return False, who
    finally:
        os.close(fd)  # also releases a lock taken just to test it


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class AtomicOutputDir:
    """A hidden folder beside `output` that replaces `output` only once everything in it is written.

    Creating it cleans leftovers of killed runs for the same output (restoring an old output a kill left
    aside) and refuses when another live run is writing that output. Use as a context manager; the
    folder yielded is written into, and on success it is marked (:data:`MARKER`) and swapped in.

    Args:
        output: the resolved output path (see :func:`check_output`).
        command: what wrote it, recorded in the marker.
    """

    def __init__(self, output: str | Path, command: str):
        self.output, self.command = Path(output), command
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self._prefix = f".{self.output.name}"
        self._token = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.tmp = self.output.parent / f"{self._prefix}{_PARTIAL}{self._token}"
        self._lock_fd = None
        self.clean_leftovers()

    def _leftovers(self, kind: str) -> list[Path]:
        return sorted(p for p in self.output.parent.glob(f"{self._prefix}{kind}*") if p != self.tmp)

    def clean_leftovers(self) -> None:
        """Remove what killed runs left for this output; restore an old output a kill left aside."""
        for path in self._leftovers(_PARTIAL):
            alive, who = _owner_alive(path)
            if alive:
                raise MergeError(
                    f"another run is writing {self.output} right now ({who or path.name}); wait for it to finish, "
                    f"or choose another output. If no such run exists, remove {path}."
                )
            shutil.rmtree(path, ignore_errors=True)
        for path in self._leftovers(".init-"):  # a kill before the lock was in place
            if not _owner_alive(path)[0]:
                shutil.rmtree(path, ignore_errors=True)
        for path in self._leftovers(_OLD):
            # A kill between the two renames of the fallback commit: the old output is here, none at output.
            if not os.path.lexists(self.output):
                os.rename(path, self.output)
            else:
                shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> Path:
        # Made under another name, then renamed: the folder never exists without its held lock file.
        init = self.output.parent / f"{self._prefix}.init-{self._token}"
        init.mkdir()
        try:
            fd = os.open(init / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            with contextlib.suppress(OSError):  # no locks on this filesystem: the pid in the file is the fallback
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
            self._lock_fd = fd
            os.rename(init, self.tmp)
        except BaseException:
            shutil.rmtree(init, ignore_errors=True)
            raise
        return self.tmp

    def _mark(self) -> None:
        files = sorted(name for name in os.listdir(self.tmp) if name != _LOCK)
        marker = {"written_by": f"hf_fsdp_qlora {self.command}", "files": files}
        with open(self.tmp / MARKER, "w") as fh:
            fh.write(json.dumps(marker, indent=2) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(self.tmp)

    def commit(self) -> None:
        """Swap the finished folder in; the old one, if any, is deleted only after that."""
        self._mark()
        # Every file gets the user's umask permissions (safetensors' save_file writes 0600 whatever the umask).
        apply_umask_mode(*(p for p in self.tmp.rglob("*") if p.is_file() and p.name != _LOCK))
        old = None
        if os.path.lexists(self.output):
            if _exchange(self.tmp, self.output):
                old = self.tmp  # one atomic step: at no instant is there no complete output
            else:
                old = self.output.parent / f"{self._prefix}{_OLD}{self._token}"
                os.rename(self.output, old)  # a kill right here is undone by the next run (clean_leftovers)
                try:
                    os.rename(self.tmp, self.output)
                except BaseException:
                    os.rename(old, self.output)
                    raise
        else:
            os.rename(self.tmp, self.output)
        _fsync_dir(self.output.parent)
        self._release()
        with contextlib.suppress(OSError):
            (self.output / _LOCK).unlink()
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _release(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._release()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()
