"""`omnistage models pull`: fetch a pipeline's hf:// models into the hub cache with the Hub's own client.

Each hf:// stage's snapshot goes to the folder `sources.local_path` resolves it to, which is where the stage,
`omnistage models check` and `serve` read it: one layout, computed in one place. The client's
`snapshot_download` into that folder (`local_dir`) resumes a partial pull and skips files already there. Where
it pulls from: HF_ENDPOINT (the public Hub when unset), with HF_TOKEN when set; the operator's init container
sets both from spec.deployment.hub.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from omnistage.api import Pipeline
from omnistage.api.model_sources import HubSource, local_path, parse_source

# The Hub client's own environment variables (huggingface_hub.constants reads the same names).
ENV_HF_ENDPOINT, ENV_HF_TOKEN, ENV_HF_OFFLINE = "HF_ENDPOINT", "HF_TOKEN", "HF_HUB_OFFLINE"


class PullError(Exception):
    """A model could not be pulled: the message names the stage, the repository and why."""


@dataclass(frozen=True)
class Pulled:
    stage: str
    source: str
    directory: Path
    files: int
    bytes: int


def hub_stages(pipeline: Pipeline, stage: str | None = None) -> list[tuple[str, HubSource]]:
    """(stage, source) of the pipeline's hf:// stages (only `stage` when given)."""
    out = []
    for s in pipeline.stages:
        source = parse_source(s.model)
        if isinstance(source, HubSource) and (stage is None or s.name == stage):
            out.append((s.name, source))
    return out


def pull_pipeline(pipeline: Pipeline, store: str | os.PathLike, stage: str | None = None,
                  env: Mapping[str, str] | None = None, progress=print) -> list[Pulled]:
    env = os.environ if env is None else env
    if env.get(ENV_HF_OFFLINE, "").strip().lower() in ("1", "true", "yes", "on"):
        raise PullError(f"{ENV_HF_OFFLINE} is set: the Hub client will not download; unset it to pull")
    out = []
    for name, source in hub_stages(pipeline, stage):
        directory = local_path(str(source), store, env)
        progress(f"{name}: pulling {source} into {directory}")
        out.append(_pull(name, source, directory, env))
    return out


def _pull(stage: str, source: HubSource, directory: Path, env: Mapping[str, str]) -> Pulled:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    endpoint = env.get(ENV_HF_ENDPOINT) or None
    token = env.get(ENV_HF_TOKEN) or None
    directory.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(source.repo_id, revision=source.revision, local_dir=directory, endpoint=endpoint,
                          token=token if token else False)
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        why = {401: "the Hub refused the token (401): set HF_TOKEN (the pipeline's spec.deployment.hub."
                    "tokenSecret) to a token that may read it",
               403: "the token may not read it (403)", 404: "no such repository or revision (404)"}.get(
                    status or 0, f"the Hub answered {status}")
        raise PullError(f"{stage}: cannot pull {source} from {endpoint or 'the public Hub'}: {why}") from None
    except (LocalEntryNotFoundError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PullError(f"{stage}: cannot pull {source} from {endpoint or 'the public Hub'}: {first}") from None
    files = [p for p in directory.rglob("*") if p.is_file() and _CLIENT_STATE not in p.relative_to(directory).parts]
    return Pulled(stage, str(source), directory, len(files), sum(p.stat().st_size for p in files))


# The client keeps its download state in the snapshot folder (`.cache/huggingface`): not model files.
_CLIENT_STATE = ".cache"
