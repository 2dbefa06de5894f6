"""A SuperNode under an account of its own: it may reach the worker's socket and secret, nothing
else of the node's.

A server ships the ClientApp's code (the FAB), and the SuperNode runs it as its own user. Run as
the worker's owner, that code can read the data, the cache and the ledger (docs/privacy.md,
'What a server that controls the code can still do'). ``car-fl worker --supernode-group G``
lets a SuperNode whose account is in group G (and not the owner) hand rounds to the worker: the
worker's folder is 0710 and its secret 0640 and socket 0660 in group G, and the worker refuses to
start while that group or any other account could read the data file, the cache, the run states
or the ledger (:func:`exposed`). What such a ClientApp gets is then what the worker releases.
"""

from __future__ import annotations

import grp
import os
import stat
import struct
from collections.abc import Iterable
from pathlib import Path

#: The modes of what the SuperNode's group may use: the folder by name only, no listing.
FOLDER_MODE, SECRET_MODE, SOCKET_MODE = 0o710, 0o640, 0o660


def group_id(name: str) -> int:
    """The id of the group ``name``; ``ValueError`` naming how to make one."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(
            f"--supernode-group {name!r}: no such group on this machine; create it and put the "
            f"SuperNode's account in it (e.g. `sudo groupadd {name}; sudo useradd -g {name} "
            "flwr-node`, docs/deployment.md 'A SuperNode that cannot read the data')"
        ) from None


def share(path: Path, gid: int, mode: int) -> None:
    """Give ``path`` to group ``gid`` with ``mode``; ``ValueError`` saying why not."""
    try:
        os.chown(path, -1, gid)
    except PermissionError:
        raise ValueError(
            f"cannot give {path} to group {gid}: the worker's owner must be a member of the "
            "SuperNode's group (e.g. `sudo usermod -aG <group> $USER`, then log in again)"
        ) from None
    os.chmod(path, mode)


def replaceable(path: Path, gid: int) -> str | None:
    """Why an account other than this process's, in group ``gid``, could put another file at
    ``path`` (it, or a folder above it, is that account's, or a folder it may write without
    the sticky bit), as written and as resolved; ``None`` when it could not."""
    me = os.getuid()
    given = Path(os.path.abspath(path.expanduser()))
    real = given.resolve()
    for place in dict.fromkeys([*given.parents, given, *real.parents, real]):
        info = place.lstat()
        if info.st_uid not in (me, 0):
            return f"{place} belongs to another account (uid {info.st_uid})"
        if stat.S_ISDIR(info.st_mode) and not info.st_mode & stat.S_ISVTX:
            bit = stat.S_IWGRP if info.st_gid == gid else stat.S_IWOTH
            if info.st_mode & bit or acl_grants(place, 2):
                return f"the folder {place} can be written by others"
    return None


def readable(path: Path, gid: int) -> bool:
    """Whether an account that is neither the owner of ``path`` nor of its folders, nor root,
    whose one group is ``gid``, could read ``path`` (every folder above it searchable). As the
    kernel does, a file of group ``gid`` answers with its group bits, any other with its others'."""

    def allows(info: os.stat_result, other: int, group: int) -> bool:
        return bool(info.st_mode & (group if info.st_gid == gid else other))

    path = path.expanduser().resolve()
    for folder in reversed(path.parents):
        if not allows(folder.stat(), stat.S_IXOTH, stat.S_IXGRP) and not acl_grants(folder, 1):
            return False
    if path.is_dir():  # listed, or entered by the names of what it holds
        own = allows(path.stat(), stat.S_IROTH | stat.S_IXOTH, stat.S_IRGRP | stat.S_IXGRP)
        return own or acl_grants(path, 4 | 1)
    return allows(path.stat(), stat.S_IROTH, stat.S_IRGRP) or acl_grants(path, 4)


#: A POSIX access ACL's named entries (``setfacl -m u:NAME:...`` or ``g:NAME:...``) and mask.
ACL_XATTR, ACL_USER, ACL_GROUP, ACL_MASK = "system.posix_acl_access", 0x02, 0x08, 0x10


def acl_grants(path: Path, bits: int) -> bool:
    """Whether ``path``'s access ACL grants any of ``bits`` (4 read, 1 search) to a named user
    or group, within its mask: to whom is not checked, so any such entry counts."""
    try:
        raw = os.getxattr(path, ACL_XATTR)
    except (OSError, AttributeError):  # no ACL, no support for them, or not Linux
        return False
    entries = [struct.unpack_from("<HHI", raw, at) for at in range(4, len(raw) - 7, 8)]
    mask = next((perm for tag, perm, _ in entries if tag == ACL_MASK), 7)
    return any(tag in (ACL_USER, ACL_GROUP) and perm & mask & bits for tag, perm, _ in entries)


def exposed(paths: Iterable[tuple[str, Path]], gid: int) -> list[str]:
    """What the SuperNode's group (or any other account) could read among ``paths`` (what each
    is, its path), each with the ``chmod`` that closes it."""
    found = []
    for what, path in paths:
        if not path.exists():
            continue
        if readable(path, gid):
            found.append(
                f"{what} {path} can be read by the SuperNode's group or by every account "
                f"(mode {stat.filemode(path.stat().st_mode)}); `chmod go-rwx {path}` or keep it "
                "in a folder only you can enter"
            )
        elif why := replaceable(path, gid):
            found.append(
                f"{what} {path} could be replaced by another account ({why}); keep it, and "
                "every folder above it, yours (or root's) and writable by you alone"
            )
    return found
