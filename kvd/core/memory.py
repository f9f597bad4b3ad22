"""Mapping engine memory into the daemon: POSIX shared memory segments.

The shim hands the daemon each KV cache segment by name (a torch shared-memory
storage, ``/torch_<pid>_<n>_<k>``); the daemon maps it with ``mmap(MAP_SHARED)``
and registers the mapping with NIXL as DRAM. The engine and the daemon then see
the same physical pages: a NIXL READ into the daemon's mapping lands in the
engine's KV cache tensor with no copy.

Raises ``SegmentError`` (a ``ValueError``) with a message for every bad input:
a name that is not a plain shm name, a missing object, a symbolic link or
anything but a regular file, or a size larger than the object (the daemon
never maps or registers bytes that are not there). Mapping on behalf of an
engine (``access``) also checks that the engine itself could open the object
read-write (``SegmentAccessError``): the daemon, which may run as another user
or as root, never lends its own rights to a caller (docs/SECURITY.md).

Memory handed over by file descriptor (:class:`FdMapping`, the preferred CPU
path, docs/SECURITY.md "Memory handover"): the engine passes a sealed memfd
over the fd side channel (``kvd.daemon.fd_channel``) and the daemon maps the
fd it received. The seals are checked on that very fd (``F_GET_SEALS``,
fcntl(2)): without ``F_SEAL_SHRINK`` the engine could ``ftruncate`` the file
under the daemon's mapping and the daemon's next access past the new end
would raise SIGBUS (mmap(2)), killing the daemon for every engine. Nothing
is named in /dev/shm on this path, so nothing is ever unlinked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import re
import stat
from dataclasses import dataclass

log = logging.getLogger("kvd.core")

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^/?[A-Za-z0-9_.\-]{1,200}$")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class SegmentError(ValueError):
    """A segment cannot be mapped; the message says why."""


class SegmentAccessError(SegmentError):
    """The engine that names a segment could not open it read-write itself."""


@dataclass(frozen=True)
class Access:
    """Credentials of the engine process a segment is mapped for (from the
    kernel, SO_PEERCRED / SO_PEERGROUPS; never from the request)."""

    uid: int
    gids: frozenset[int]

    def check(self, name: str, st: os.stat_result) -> None:
        """Raises SegmentAccessError unless these credentials may read and
        write an object of ``st``'s owner, group and mode (the owner, group,
        other classes of open(2); root may always)."""
        if self.uid == 0:
            return
        if st.st_uid == self.uid:
            need, who = stat.S_IRUSR | stat.S_IWUSR, "owner"
        elif st.st_gid in self.gids:
            need, who = stat.S_IRGRP | stat.S_IWGRP, "group"
        else:
            need, who = stat.S_IROTH | stat.S_IWOTH, "other"
        if st.st_mode & need != need:
            raise SegmentAccessError(
                f"segment {name!r}: permission denied: uid {self.uid} may not read and write it "
                f"(owner {st.st_uid}, group {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}, as {who})")


def shm_path(name: str) -> str:
    """``/dev/shm`` path of a POSIX shm object name (``/x`` or ``x``).

    Raises:
        SegmentError: the name has a path separator, ``..`` or odd characters.
    """
    if not _NAME_RE.match(name) or ".." in name:
        raise SegmentError(f"invalid shared-memory name {name!r}")
    return os.path.join(SHM_DIR, name.lstrip("/"))


def create_shm(size: int, prefix: str = "kvd-stage", uid: int = -1) -> str:
    """Creates a new POSIX shm object of ``size`` bytes; returns its name.

    Used for daemon-owned staging mirrors (``data_path = staged``), which
    the registering engine (uid ``uid``; -1: the daemon's own) maps too:
    mode 0600, owned by that uid, so no other user can open one engine's
    mirror (before: 0660 with the daemon's group, open to every member of
    it). A daemon that may not give the object away (not root, another
    uid) keeps it 0660 with its group, the only way that engine can open it.
    The creator unlinks it with :func:`unlink_shm`.
    """
    import uuid

    name = f"/{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    fd = os.open(shm_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        mode = 0o600
        if uid >= 0 and uid != os.geteuid():
            try:
                os.fchown(fd, uid, -1)
            except PermissionError:
                mode = 0o660
        os.fchmod(fd, mode)  # not narrowed by the umask
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        unlink_shm(name)
        raise
    os.close(fd)
    return name


def unlink_shm(name: str, identity: tuple[int, int] | None = None) -> bool:
    """Removes a shm object; idempotent. True when it removed one; False
    when there was none or it could not be (logged).

    ``identity``: ``(st_dev, st_ino)`` of the object that was mapped
    (``ShmMapping.identity``); the name is removed only while it still
    names that object. An engine's name may have been unlinked and made
    again by another user since (/dev/shm is shared): a root daemon
    unlinking by name alone removed that user's object. The check and the
    unlink are two calls; only the name's owner can swap the object in
    between (the sticky /dev/shm keeps others from removing it), so at worst
    an object of that same owner is removed. The check looks the name up
    without asking another mount's file system (:func:`_lookup_on_shm`): an
    ``lstat`` of a name with the engine's FUSE mounted over it waited for
    the engine's server (15 s, attacker review).
    """
    path = shm_path(name)
    try:
        if identity is not None:
            where = _lookup_on_shm(name, path)
            try:
                st = os.fstat(where)  # on /dev/shm's own file system
            finally:
                os.close(where)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != identity:
                return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except (OSError, SegmentError) as e:
        log.warning("shm object %s not removed: %s", name, e)
        return False


def _mount_id(fd: int) -> int:
    """The mount id of an open fd, from ``/proc/self/fdinfo`` (procfs alone
    answers: nothing asks the file's own file system)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOTSUP, "no mnt_id in /proc/self/fdinfo")


def _lookup_on_shm(name: str, path: str) -> int:
    """An ``O_PATH | O_NOFOLLOW`` fd of ``path`` (a name in :data:`SHM_DIR`),
    only if it is on the file system mounted at :data:`SHM_DIR`.

    Why: an engine may mount FUSE over a file of its own in /dev/shm
    (setuid ``fusermount3`` allows it on a file the user owns), and an
    ``open()`` or ``stat()`` there waits for the engine's FUSE server, on
    the daemon's event loop (an attacker review held it 59 s). An
    ``O_PATH`` open is a lookup (nothing reaches the file system's own
    code), and the mount ids are read from ``/proc/self/fdinfo``.

    Raises:
        SegmentError: the name is on another mount (one over it).
        OSError: from the lookup (FileNotFoundError, ...).
    """
    where = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        top = os.open(SHM_DIR, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            same = _mount_id(where) == _mount_id(top)
        finally:
            os.close(top)
    except BaseException:
        os.close(where)
        raise
    if not same:
        os.close(where)
        raise SegmentError(f"segment {name!r} is not a file of {SHM_DIR}'s file system (a mount over it); "
                           f"refused")
    return where


def _open_on_shm(name: str, path: str, flags: int) -> int:
    """Opens ``path`` (a name in :data:`SHM_DIR`) with ``flags``, only if it
    is a regular file of the file system mounted at :data:`SHM_DIR`: looked
    up first (:func:`_lookup_on_shm`), then the very file found is reopened
    through ``/proc/self/fd`` (no second lookup: a mount made meanwhile is
    not crossed).

    Raises:
        SegmentError: a symbolic link, not a regular file, or on another
            mount. OSError from the opens (FileNotFoundError, ...).
    """
    where = _lookup_on_shm(name, path)
    try:
        mode = os.fstat(where).st_mode  # on /dev/shm's own file system: answered there
        if stat.S_ISLNK(mode):
            raise OSError(errno.ELOOP, "is a symbolic link")
        if not stat.S_ISREG(mode):
            raise SegmentError(f"segment {name!r} is not a shared memory object")
        return os.open(f"/proc/self/fd/{where}", flags)
    finally:
        os.close(where)


class ShmMapping:
    """A read-write ``MAP_SHARED`` mapping of one POSIX shm object.

    Args:
        name: shm object name as the engine gave it.
        size: bytes to map, from 1 to the object's size.
        access: the engine's credentials; None for the daemon's own objects.

    Attributes:
        addr: virtual address of the first byte in this process.
        size: mapped length in bytes.
        identity: ``(st_dev, st_ino)`` of the object mapped.

    Raises:
        SegmentError: bad name, missing object, not a regular file, or
            ``size`` larger than it.
        SegmentAccessError: ``access`` may not read and write the object.

    Close with :meth:`close` once NIXL has deregistered the memory.
    """

    kind = "shm"

    def __init__(self, name: str, size: int, access: Access | None = None):
        path = shm_path(name)
        if size <= 0:
            raise SegmentError(f"segment {name!r}: size must be > 0 (got {size})")
        try:
            # /dev/shm is writable by everyone: never follow a planted link.
            # O_NONBLOCK: a lease the engine holds on its object (F_SETLEASE)
            # made this open wait for the lease to break, lease-break-time
            # (45 s here), on the event loop (attacker review): EWOULDBLOCK now.
            fd = _open_on_shm(name, path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise SegmentError(f"segment {name!r} does not exist in {SHM_DIR}") from None
        except BlockingIOError:
            raise SegmentError(f"segment {name!r} is leased by its owner (F_SETLEASE): it cannot be opened now; "
                               f"release the lease") from None
        except PermissionError:
            raise SegmentError(f"segment {name!r}: permission denied") from None
        except OSError as e:
            why = "is a symbolic link" if e.errno == errno.ELOOP else f"cannot open: {e.strerror or e}"
            raise SegmentError(f"segment {name!r} {why}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentError(f"segment {name!r} is not a shared memory object")
            if access is not None:
                access.check(name, st)  # on the very object mapped below: no race
            actual = st.st_size
            if size > actual:
                raise SegmentError(f"segment {name!r}: {size} bytes asked, the object has {actual}")
            addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                err = ctypes.get_errno()
                raise SegmentError(f"segment {name!r}: mmap failed: {os.strerror(err)}")
        finally:
            os.close(fd)
        self.name = name
        self.addr = int(addr)
        self.size = size
        self.identity = (st.st_dev, st.st_ino)  # which object this is (unlink_shm)

    def read(self, offset: int, length: int) -> bytes:
        """Copies ``length`` bytes at ``offset`` (for checks and tests)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise SegmentError(f"read [{offset}, {offset + length}) outside segment of {self.size} bytes")
        return ctypes.string_at(self.addr + offset, length)

    def close(self) -> None:
        """Unmaps; idempotent."""
        if self.addr:
            _libc.munmap(self.addr, self.size)
            self.addr = 0


MEMFD_KIND = "memfd"
#: Seals the daemon requires on a handed-over fd: it can then never shrink.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK


def memfd_seals(fd: int, label: str = "memfd") -> int:
    """The seals of ``fd`` (``F_GET_SEALS``), which only shared memory
    (shmem: memfds, tmpfs files) has: the kernel answers without calling
    into any filesystem (``memfd_fcntl``, mm/memfd.c), so it is safe on the
    event loop whatever file an engine sent.

    Raises:
        SegmentError: not an open fd, or not shared memory made with
            ``MFD_ALLOW_SEALING``.
    """
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        if e.errno == errno.EBADF:
            raise SegmentError(f"{label}: not an open file descriptor ({e.strerror})") from None
        raise SegmentError(f"{label}: the fd cannot be sealed (not a memfd made with MFD_ALLOW_SEALING)") from None


def check_sealed(fd: int, size: int, label: str = "memfd") -> os.stat_result:
    """Checks that ``fd`` is shared memory the daemon may map ``size`` bytes
    of, read-write, and that cannot shrink; returns its ``fstat``.

    Raises:
        SegmentError: not a regular file; not open read-write; no seals at
            all (``F_GET_SEALS`` fails: not a memfd / shmem file) or no
            ``F_SEAL_SHRINK``; ``size`` <= 0 or larger than the file.
    """
    seals = memfd_seals(fd, label)
    # fstat only now: on a file of a FUSE mount it asks the mount's server,
    # which may never answer (an engine's own FUSE file held the event loop
    # 22 s, attacker review); F_GET_SEALS and F_GETFL ask no filesystem.
    try:
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        st = os.fstat(fd)
    except OSError as e:
        raise SegmentError(f"{label}: not an open file descriptor ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise SegmentError(f"{label}: not a memory file (a memfd is expected)")
    if mode != os.O_RDWR:
        raise SegmentError(f"{label}: the fd is not open read-write")
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise SegmentError(f"{label}: the memfd is not sealed against shrinking (F_SEAL_SHRINK missing; "
                           f"seals 0x{seals:x}): the engine could truncate it under the daemon")
    if size <= 0:
        raise SegmentError(f"{label}: size must be > 0 (got {size})")
    if size > st.st_size:
        raise SegmentError(f"{label}: {size} bytes asked, the memfd has {st.st_size}")
    return st


class FdMapping(ShmMapping):
    """A read-write ``MAP_SHARED`` mapping of a sealed memfd the engine handed over.

    Args:
        fd: the fd received (``kvd.daemon.fd_channel``); the caller keeps
            owning it and closes it (the mapping holds the pages, not the fd).
        size: bytes to map from the file's start.
        label: names the segment in messages (e.g. the fd id).

    Raises:
        SegmentError: see :func:`check_sealed`; mmap failed.

    Attributes as :class:`ShmMapping`; ``name`` is ``label``. Close with
    :meth:`close` once NIXL has deregistered the memory.
    """

    kind = MEMFD_KIND

    def __init__(self, fd: int, size: int, label: str = "memfd"):  # noqa: super().__init__ opens by name
        check_sealed(fd, size, label)
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise SegmentError(f"{label}: mmap failed: {os.strerror(ctypes.get_errno())}")
        self.name = label
        self.addr = int(addr)
        self.size = size
