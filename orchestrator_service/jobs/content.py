"""The finished jobs' content (MP4, thumbnail, spritesheet, preview) as files: `root/<job id>/<variant>`.

On a cluster the root is a volume every orchestrator replica mounts, so any replica serves what another
one made. A file is written under a temporary name in its job's folder and renamed into place, so a reader
sees the whole file or none; deleting a job's folder also removes what a crashed write left behind.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

# Job ids and variant names become path components: only these characters, so none climbs out of the root.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
# Where a write lies until it is renamed into place; never a variant's name (the dot is not allowed there).
_PARTIAL = ".partial-"


def _checked(what: str, name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"{what} {name!r}: letters, digits, '_' and '-' only (at most 128)")
    return name


# fsync on a directory is refused by some file systems (network ones among them) with these; the rename is done
# by then, so the file is kept and only its survival of a power loss is the file system's (PostgreSQL's
# fsync_fname ignores the same two for directories).
_FOLDER_SYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.EBADF})


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in _FOLDER_SYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


class ContentStore:
    def __init__(self, root: Path | str):
        self.root = Path(root)

    def put(self, job_id: str, variant: str, data: bytes | Path) -> int:
        """Store `data` (bytes, or a copy of the file at that path) as the job's `variant`; its size in bytes."""
        folder = self.root / _checked("job id", job_id)
        target = folder / _checked("variant", variant)
        folder.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=folder, prefix=_PARTIAL + variant + ".")
        try:
            with os.fdopen(fd, "wb") as out:
                if isinstance(data, Path):
                    with data.open("rb") as source:
                        shutil.copyfileobj(source, out)
                else:
                    out.write(data)
                size = out.tell()
                out.flush()
                os.fsync(out.fileno())  # on disk before the rename makes it visible: no empty file after a crash
            os.replace(partial, target)
            _sync_folder(folder)  # the rename itself on disk: a finished job's file survives a crash
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
        return size

    def path(self, job_id: str, variant: str) -> Path | None:
        """The variant's file, or None when it was never stored (or was deleted)."""
        target = self.root / _checked("job id", job_id) / _checked("variant", variant)
        return target if target.is_file() else None

    def delete(self, job_id: str) -> None:
        """Remove everything stored for the job (nothing stored is no error)."""
        shutil.rmtree(self.root / _checked("job id", job_id), ignore_errors=True)
