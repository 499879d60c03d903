"""Files the root hooks trust: owner and mode checks, and writes that cannot be redirected.

The Prolog, Epilog and mapa-agent run as root on paths named in a config. Like sshd's
StrictModes, they trust a file or directory only when it and every directory above it belong to
root (or to the user running the hooks, for tests and unprivileged trials) and are not writable
by group or others (a sticky directory such as /tmp is allowed above it). Writes go to a new,
unpredictably named file in the same directory (O_EXCL, O_NOFOLLOW) that is then renamed over
the target, so a planted symlink is replaced, never followed. Reads do not follow symlinks either.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from ..errors import MapaError


class UnsafePath(MapaError):
    """A path root would trust belongs to someone else, is writable by others, or is a symlink."""


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _check_entry(path: Path, info: os.stat_result, what: str) -> None:
    if not _trusted_owner(info.st_uid):
        raise UnsafePath(f"{what} {path} belongs to uid {info.st_uid}; accepted: owned by root (uid 0)")
    writable_by_others = stat.S_IMODE(info.st_mode) & 0o022
    if writable_by_others and not (stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX and what == "directory above"):
        raise UnsafePath(
            f"{what} {path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); accepted: not group/world-writable"
        )


def check_ancestors(path: Path) -> None:
    """Every directory above ``path`` is root's and not writable by others (sticky ones allowed)."""
    for parent in Path(os.path.abspath(path)).parents:
        try:
            info = os.lstat(parent)
        except OSError as error:
            raise UnsafePath(f"cannot inspect {parent}: {error.strerror}") from None
        if stat.S_ISLNK(info.st_mode):
            info = os.stat(parent)  # a symlinked system directory (/var/run -> /run) is judged by its target
        _check_entry(parent, info, "directory above")


def _check_trusted(path: Path, is_kind, what: str, accepted: str) -> None:
    try:
        info = os.lstat(path)
    except OSError as error:
        raise UnsafePath(f"cannot inspect {what} {path}: {error.strerror}") from None
    if not is_kind(info.st_mode):
        raise UnsafePath(f"{path} is not a {accepted} (a symlink or something else); accepted: a {accepted} owned by root")
    _check_entry(path, info, what)
    check_ancestors(path)


def check_trusted_dir(path: Path) -> None:
    """``path`` is a real directory (no symlink) that only root can change; raises UnsafePath."""
    _check_trusted(path, stat.S_ISDIR, "directory", "real directory")


def ensure_trusted_dir(path: Path, mode: int = 0o755) -> None:
    """Create ``path`` (and missing parents, mode 755) if needed, then check it as check_trusted_dir."""
    path = Path(os.path.abspath(path))
    if not os.path.lexists(path):
        try:
            for missing in [*reversed(path.parents), path]:
                if not os.path.lexists(missing):
                    try:
                        os.mkdir(missing)
                    except FileExistsError:
                        continue  # made by a concurrent hook just now; judged below like any other
                    os.chmod(missing, mode if missing == path else 0o755)  # whatever the umask
        except OSError as error:
            raise UnsafePath(f"cannot create directory {path}: {error.strerror}") from None
    check_trusted_dir(path)


def check_trusted_file(path: Path) -> None:
    """``path`` is a regular file, no symlink, root's, not writable by others, in trusted directories."""
    _check_trusted(path, stat.S_ISREG, "file", "regular file")


def read_bytes(path: Path, limit: int, *, follow_symlinks: bool = False) -> bytes:
    """At most ``limit`` + 1 bytes of a regular file (so a caller can tell "more than ``limit``"),
    without following a symlink unless asked (as dlopen and Slurm follow them); OSError when it is
    missing, unreadable, a symlink not to be followed, or no regular file (a FIFO would block)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        chunks = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_temporary(target: Path, data: bytes, mode: int) -> str:
    """``data`` in a new file beside ``target`` under a fresh unpredictable name (O_EXCL, so never
    through a planted link); returns its path. Nothing is left behind if writing fails."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def replace_file(target: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``target`` whole or not at all, through a fresh unpredictable temporary name."""
    target = Path(target)
    tmp = _write_temporary(target, data, mode)
    try:
        os.replace(tmp, target)  # replaces a planted symlink itself, never what it points to
    except BaseException:
        os.unlink(tmp)
        raise


def create_file(target: Path, data: bytes, mode: int = 0o644) -> bool:
    """Create ``target`` whole with ``data`` unless something is there already (then False):
    written under a fresh name and hard-linked into place, which fails rather than replaces."""
    target = Path(target)
    tmp = _write_temporary(target, data, mode)
    try:
        os.link(tmp, target, follow_symlinks=False)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def remove(path: Path) -> None:
    """Unlink ``path`` if it is there (a symlink is removed, not followed)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def resolve_trusted_file(path: Path, max_links: int = 40) -> Path:
    """The file ``path`` names after its symlinks, each link's directories and the file itself judged
    as check_trusted_file would (a link in a directory others can change could be re-pointed).

    For programs root runs by a configured name (the interpreter, scontrol): /usr/bin/python3 is a
    symlink to python3.X, so the link itself is allowed, but only in trusted directories.
    """
    current = os.path.abspath(path)
    for _ in range(max_links):
        check_ancestors(Path(current))
        try:
            info = os.lstat(current)
        except OSError as error:
            raise UnsafePath(f"cannot inspect {current}: {error.strerror}") from None
        if not stat.S_ISLNK(info.st_mode):
            check_trusted_file(Path(current))
            return Path(current)
        current = os.path.join(os.path.dirname(current), os.readlink(current))
    raise UnsafePath(f"{path}: more than {max_links} symlinks; accepted: a regular file or a short chain of symlinks to one")


def append_log_line(path: Path, line: str, mode: int = 0o640) -> None:
    """Append one line to a log file root keeps; OSError or UnsafePath if it must not or cannot.

    Like append_line, and the opened file must be a regular file with a single link, owned by root
    (or this user): a planted symlink, FIFO or hard link to another file is refused, not written
    through. A log an older version created writable by others (umask 000) is narrowed to ``mode``.
    The directory is not judged: Ubuntu's /var/log is group-writable (syslog), and these checks on
    the opened file are what keep root's appends where they belong.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    fd = os.open(path, flags, mode)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise UnsafePath(f"log {path} is not a regular file with one link; accepted: a plain file root created")
        if not _trusted_owner(info.st_uid):
            raise UnsafePath(f"log {path} belongs to uid {info.st_uid}; accepted: owned by root (uid 0)")
        if stat.S_IMODE(info.st_mode) & 0o022:
            os.fchmod(fd, stat.S_IMODE(info.st_mode) & ~0o022)
        os.write(fd, line.encode("utf-8", "backslashreplace"))
    finally:
        os.close(fd)


def command_path(command: str) -> Path | None:
    """The file a command run without a shell and without PATH would execute, or None if none.

    What subprocess does with the hooks' bare environment: a name with a slash is that path, a
    bare name is looked up in os.defpath (/bin:/usr/bin).
    """
    if not command:
        return None
    if "/" in command:
        candidates = [command]
    else:
        candidates = [os.path.join(directory or ".", command) for directory in os.defpath.split(os.pathsep)]
    for candidate in candidates:
        if os.path.lexists(candidate):
            return Path(os.path.abspath(candidate))
    return None
