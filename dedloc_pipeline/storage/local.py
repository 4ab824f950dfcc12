"""A folder as a bucket: the calls where a disk needs more than fsspec's generic ones so that it
behaves as S3 does (a write lands whole, a marker is created at most once, a pruned prefix lists
as absent). The Bucket calls these when its URL is a path or ``file://``; ``get_if_changed``,
``objects`` and ``delete`` also when it is ``memory://``, or any other store but S3."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from tenacity import Retrying

from .stats import IOStats

ATTEMPTS = 3  # a write whose folder a prune removes meanwhile makes it again: on S3 no folder is in the way


def write(fs, path: str, data: bytes) -> None:
    """``data`` at ``path`` whole: written beside it, then renamed into place."""
    _again(lambda: _placed(fs, path, data, fs.mv))


def create(fs, path: str, data: bytes) -> None:
    """``data`` at ``path`` whole, FileExistsError if something is there: a hard link fails
    where a rename would replace."""
    _again(lambda: _placed(fs, path, data, fs.link))


def _placed(fs, path: str, data: bytes, place: Callable[[str, str], None]) -> None:
    with _beside(fs, path, data) as tmp:
        place(tmp, path)


def _again(attempt: Callable[[], None]) -> None:
    """``attempt`` again where its folder vanished under it (FileNotFoundError: a prune of the
    same prefix removed it between the folder's making and the write), ``ATTEMPTS`` times at most."""
    for i in range(ATTEMPTS):
        try:
            return attempt()
        except FileNotFoundError:
            if i == ATTEMPTS - 1:
                raise


@contextmanager
def _beside(fs, path: str, data: bytes) -> Iterator[str]:
    """A whole copy beside ``path``, under a hidden name, to be renamed or linked into place;
    gone afterwards, however that went."""
    head, name = os.path.split(path)
    fs.makedirs(head, exist_ok=True)
    tmp = f"{head}/.{uuid.uuid4().hex[:8]}.{name}"
    try:
        fs.pipe_file(tmp, data)
        yield tmp
    finally:
        with suppress(FileNotFoundError):
            os.unlink(tmp)


def get_if_changed(fs, path: str, tag: str | None, limit: int | None = None) -> tuple[bytes | None, str | None, bool]:
    """As ``s3.get_if_changed`` (``Fetched``'s fields), by a stat first: the object's bytes,
    at most ``limit`` of them, unless its ``_tag`` is still ``tag``."""
    try:
        now = _tag(fs.info(path))
        if tag is not None and now == tag:
            return None, tag, False
        return fs.cat_file(path, end=limit), now, True
    except FileNotFoundError:
        return None, None, True


def _tag(info: dict) -> str | None:
    """An object's version tag from its listing or stat: the ETag where the store has one; on a
    local disk the inode, mtime and size (every write is a rename into place, so a new inode);
    None where the store has nothing that changes with every write (memory://: always read again)."""
    if "ETag" in info:
        return str(info["ETag"])
    if "ino" in info and "mtime" in info:
        return f"{info['ino']:x}-{info['mtime']!r}-{info.get('size', 0):x}"
    return None


def objects(fs, path: str, stats: IOStats,
            after: Callable[[str], str | None] | None = None) -> dict[str, tuple[int, str | None]]:
    """Every file below ``path`` with its size and ``_tag``, counted as S3 would bill the listing
    (a LIST a 1000 keys). ``after``: as ``s3.objects``'s, the keys up to where it says to go on
    left out alike."""
    try:
        found = sorted(fs.find(path, detail=True).items())
    except FileNotFoundError:
        found = []
    stats.add("list", n=1 + len(found) // 1000)
    kept, skip = {}, None
    for p, info in found:
        rest = p[len(path) + 1:]
        if skip is not None and rest <= skip:
            continue  # what a StartAfter would leave out
        kept[p] = (int(info.get("size") or 0), _tag(info))
        if after is not None:
            skip = after(rest) or skip
    return kept


def delete(fs, path: str, kept: Callable[[str], bool] | None, retry: Retrying) -> None:
    """The file or folder ``path`` and everything below it but the paths ``kept`` says (None:
    nothing kept, one recursive removal), each removal retried alone, so a long prune gets
    through; folders left empty go too."""
    try:
        if kept is None:
            fs.rm(path, recursive=True)
            return
        found = fs.find(path, withdirs=True, detail=True)
    except FileNotFoundError:
        return
    for p, info in found.items():
        if info["type"] != "directory" and not kept(p):
            retry(_remove, fs, p)
    # where folders are real: a pruned prefix lists as absent, as on S3
    for p in sorted((p for p, info in found.items() if info["type"] == "directory"), key=len, reverse=True):
        retry(_remove, fs, p, True)


def _remove(fs, path: str, folder: bool = False) -> None:
    """A file, or a folder if it is empty; gone already is removed (a retried removal)."""
    try:
        if not folder:
            fs.rm_file(path)
        elif fs.isdir(path) and not fs.ls(path):
            fs.rmdir(path)
    except FileNotFoundError:
        pass
