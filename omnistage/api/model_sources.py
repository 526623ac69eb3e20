"""Where a stage's weights come from: the one reader of `spec.topology.stages[].model`.

A model source is one of:
- a path: absolute, or relative to the model store ($OMNISTAGE_MODEL_DIR, else ./models);
- `pvc://CLAIM/PATH`: PATH inside an existing PersistentVolumeClaim of the pipeline's namespace, which the
  operator mounts read-only in the stage's pod at `CLAIM_MOUNT_ROOT/CLAIM`;
- `hf://ORG/NAME@REVISION`: a Hugging Face Hub repository at a revision (a branch, a tag or a commit), pulled
  by `omnistage models pull` (on a cluster, the stage pod's init container) into the hub cache, at
  `HUB_CACHE/ORG/NAME/REVISION`. Nothing is downloaded at serve time: a stage whose snapshot is missing is
  refused by the model check.

Pure: parsing, refusals and the local layout; the download itself is `omnistage.checkpoints.pull`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Mapping, Union
from urllib.parse import quote

CLAIM_SCHEME = "pvc://"
HUB_SCHEME = "hf://"
# Where the operator mounts a stage's pvc:// claim: one folder per claim, beside (not inside) the model store.
CLAIM_MOUNT_ROOT = "/mnt/omnistage-claims"
# The hub cache's root; default: `hub` under the model store. The operator sets it in the stage pod's init
# container (which fills it) and in the stage container (which reads it), so both resolve one path.
ENV_HUB_CACHE = "OMNISTAGE_HUB_CACHE"
HUB_CACHE_DIR = "hub"
# A claim's name, as Kubernetes checks it (a DNS-1123 subdomain).
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_CLAIM_MAX = 253
# A Hub repository's owner and name, as the Hub checks them: letters, digits, "-", "_", "."; no "--" or "..";
# at most 96 characters each.
_HUB_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
_HUB_PART_MAX = 96
# A revision: a branch, a tag (git ref names, "/" allowed: "refs/pr/1") or a commit.
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
_REVISION_MAX = 255


class SourceError(ValueError):
    """A `model` that is no model source: the message says what is wrong."""


@dataclass(frozen=True)
class LocalSource:
    path: str


@dataclass(frozen=True)
class ClaimSource:
    claim: str
    path: str            # inside the claim, relative

    @property
    def mount_path(self) -> str:
        return f"{CLAIM_MOUNT_ROOT}/{self.claim}"


@dataclass(frozen=True)
class HubSource:
    org: str
    name: str
    revision: str

    @property
    def repo_id(self) -> str:
        return f"{self.org}/{self.name}"

    def __str__(self) -> str:
        return f"{HUB_SCHEME}{self.repo_id}@{self.revision}"


ModelSource = Union[LocalSource, ClaimSource, HubSource]


def parse_source(text: str) -> ModelSource:
    """The source a stage's `model` names; SourceError saying what is wrong when it names none."""
    if not text:
        raise SourceError("must name a model: a folder, pvc://CLAIM/PATH or hf://ORG/NAME@REVISION")
    if text.startswith(CLAIM_SCHEME):
        return _claim(text[len(CLAIM_SCHEME):])
    if text.startswith(HUB_SCHEME):
        return _hub(text[len(HUB_SCHEME):])
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise SourceError(f'unknown model source scheme "{scheme}://" (a folder, pvc://CLAIM/PATH or '
                          "hf://ORG/NAME@REVISION)")
    return LocalSource(text)


def source_error(text: str) -> str | None:
    """What is wrong with `text` as a model source, None when nothing is (validation's view)."""
    try:
        parse_source(text)
    except SourceError as e:
        return str(e)
    return None


def _claim(rest: str) -> ClaimSource:
    claim, _, path = rest.partition("/")
    if not claim:
        raise SourceError("pvc://CLAIM/PATH needs the claim's name")
    if len(claim) > _CLAIM_MAX or not _CLAIM.match(claim):
        raise SourceError(f'pvc:// claim "{claim}" must be a PersistentVolumeClaim name: lower-case letters, '
                          'digits, "-" and ".", starting and ending with a letter or digit')
    _relative(path, f"pvc://{claim}/PATH")
    return ClaimSource(claim, path.strip("/"))


def _relative(path: str, what: str) -> None:
    if not path.strip("/"):
        raise SourceError(f"{what} needs the model's folder inside the claim")
    parts = PurePosixPath(path).parts
    if path.startswith("/") or ".." in parts or "." in path.split("/"):
        raise SourceError(f'{what}: "{path}" must be a relative folder without "." or ".."')


def _hub(rest: str) -> HubSource:
    repo, at, revision = rest.partition("@")
    if not at or not revision:
        raise SourceError(f'hf://{repo} needs a revision: hf://ORG/NAME@REVISION (a branch, tag or commit), '
                          "so every replica loads the same weights")
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts):
        raise SourceError(f'hf:// repository "{repo}" must be ORG/NAME')
    for part in parts:
        if len(part) > _HUB_PART_MAX or not _HUB_PART.match(part) or "--" in part or ".." in part:
            raise SourceError(f'hf:// repository "{repo}": "{part}" must be letters, digits, "-", "_" and "." '
                              f'(no "--" or ".."), at most {_HUB_PART_MAX} characters')
    if len(revision) > _REVISION_MAX or not _REVISION.match(revision) or ".." in revision \
            or "//" in revision or revision.endswith("/"):
        raise SourceError(f'hf:// revision "{revision}" must be a branch, tag or commit: letters, digits, '
                          '"-", "_", "." and "/"')
    return HubSource(parts[0], parts[1], revision)


# ------------------------------------------------------------------------------ layout

def hub_cache(store: str | os.PathLike, env: Mapping[str, str] | None = None) -> Path:
    """The hub cache's root: $OMNISTAGE_HUB_CACHE, else `hub` under the model store."""
    env = os.environ if env is None else env
    return Path(env.get(ENV_HUB_CACHE) or Path(store) / HUB_CACHE_DIR)


def hub_snapshot_dir(source: HubSource, cache: str | os.PathLike) -> Path:
    """Where a pulled snapshot lies in the cache: ORG/NAME/REVISION (a revision's "/" quoted, so one
    revision is one folder)."""
    return Path(cache) / source.org / source.name / quote(source.revision, safe="")


def local_path(text: str, store: str | os.PathLike, env: Mapping[str, str] | None = None) -> Path:
    """The folder a stage reads its model from, for any source (the one resolution the stage, the check,
    the orchestrator's limits and `omnistage models pull` share)."""
    source = parse_source(text)
    if isinstance(source, HubSource):
        return hub_snapshot_dir(source, hub_cache(store, env))
    if isinstance(source, ClaimSource):
        return Path(source.mount_path) / source.path
    path = Path(source.path)
    return path if path.is_absolute() else Path(store) / path


def missing_hint(text: str) -> str:
    """What to do when a stage's model folder is missing, by its source."""
    try:
        source = parse_source(text)
    except SourceError:
        return ""
    if isinstance(source, HubSource):
        return f"{source} is not pulled: run `omnistage models pull` on the pipeline file"
    if isinstance(source, ClaimSource):
        return (f"the claim {source.claim} is mounted at {source.mount_path} in the stage's pod only (the "
                "operator mounts it); locally, name the folder instead")
    return ""


COMMIT = re.compile(r"^[0-9a-f]{40}$")


def is_commit(revision: str) -> bool:
    """Whether a Hub revision names a commit (40 hex digits), which never moves, not a branch or tag."""
    return bool(COMMIT.match(revision))


def hub_revision(text: str) -> str | None:
    """The revision of an hf:// source; None for any other source (or one that does not parse)."""
    try:
        source = parse_source(text)
    except ValueError:
        return None
    return source.revision if isinstance(source, HubSource) else None
