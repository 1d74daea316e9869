"""The Hugging Face Hub: references to its repositories and their local snapshots.

A base model may be named by its Hub id (`org/name[@revision]`, the server's `engine.model`) and an
adapter by an `hf://org/name[@revision][/folder]` source. Both resolve to a local snapshot with
huggingface_hub, as vLLM does: its cache (HF_HOME, HF_HUB_CACHE), its token (HF_TOKEN or
`hf auth login`) and its offline mode (HF_HUB_OFFLINE) are honoured. This module depends on
nothing else in loraplex, so the server and the registry both use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypedDict

HUB_SCHEME = "hf://"


@dataclass(frozen=True)
class HubRef:
    """`org/name` or `org/name@revision` (a branch, tag or commit)."""

    repo_id: str
    revision: str | None = None

    @classmethod
    def parse(cls, text: str) -> HubRef | None:
        """The reference `text` spells, or None if it is not a valid Hub repository id."""
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        repo_id, at, revision = text.strip().partition("@")
        if at and not revision:
            return None
        try:
            validate_repo_id(repo_id)
        except HFValidationError:
            return None
        return cls(repo_id, revision or None)

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class HubFolder:
    """A folder of a model repository at a revision: what `hf://org/name[@rev][/folder]` names."""

    ref: HubRef
    folder: str = ""  # '/'-separated, relative to the repository's root; "" is the root

    @classmethod
    def parse(cls, uri: str) -> HubFolder:
        """Parse with huggingface_hub's own `hf://` grammar (a revision holding '/' is written
        `%2F`, or is a `refs/pr/N`); raises ValueError naming what is wrong. The folder may not
        climb (`..`) and the revision may not name a path out of the cache's refs/."""
        from huggingface_hub import parse_hf_uri

        parsed = parse_hf_uri(uri)  # HfUriError is a ValueError
        if parsed.type != "model":
            raise ValueError(f"{uri!r} names a {parsed.type} repository; adapters live in models")
        folder = parsed.path_in_repo.strip("/")
        for name, value in (("folder", folder), ("revision", parsed.revision or "")):
            parts = PurePosixPath(value).parts
            if ".." in parts or "." in parts or any(ord(c) < 0x20 for c in value):
                raise ValueError(f"the {name} of {uri!r} may not hold '.', '..' or control codes")
        return cls(HubRef(parsed.id, parsed.revision), folder)

    def __str__(self) -> str:
        return HUB_SCHEME + str(self.ref) + (f"/{self.folder}" if self.folder else "")


class HubError(LookupError):
    """A Hub reference that cannot be resolved: `detail` says why, the message names `ref` too."""

    def __init__(self, ref: HubRef, detail: str) -> None:
        super().__init__(f"{ref}: {detail}")
        self.detail = detail


class HubUnavailable(HubError):
    """The Hub (or the cache's disk) failed and the cache cannot stand in: a retry may work."""


def _cached_revisions(cache_dir: Path, repo_id: str) -> list[str] | None:
    """Branch or tag names and commits of `repo_id` in the cache; None if it has none of it."""
    folder = cache_dir / ("models--" + repo_id.replace("/", "--"))
    if not folder.is_dir():
        return None
    found: list[str] = []
    for kind in ("refs", "snapshots"):
        if (folder / kind).is_dir():
            found += sorted(p.name for p in (folder / kind).iterdir())
    return found


class _SnapshotArgs(TypedDict):
    revision: str | None
    cache_dir: Path
    token: str | None
    allow_patterns: list[str]
    ignore_patterns: list[str]


def hub_snapshot(
    ref: HubRef,
    allow_patterns: tuple[str, ...],
    *,
    cache_dir: Path | None = None,
    token: str | None = None,
    folder: str = "",
    check_sizes: Callable[[dict[str, int]], None] | None = None,
) -> Path:
    """The local snapshot folder of `ref`, downloaded into the Hugging Face cache if it is not
    there: only the files of `folder` (the repository's root by default) matching
    `allow_patterns`, none of its subfolders'. While the Hub answers, `check_sizes` is first
    given those files' sizes by name within `folder`, and may raise to stop the download before
    a byte of it moves; offline, the cache holds what it holds. Raises HubError."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        DryRunError,
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    prefix = f"{folder}/" if folder else ""
    args = _SnapshotArgs(
        revision=ref.revision,
        cache_dir=cache,
        token=token,
        allow_patterns=[prefix + p for p in allow_patterns],
        ignore_patterns=[prefix + "*/*"],
    )
    try:
        if check_sizes is not None:
            try:
                planned = snapshot_download(ref.repo_id, **args, dry_run=True)
            except DryRunError:  # offline or unreachable: the cache answers below
                pass
            else:
                check_sizes({f.filename.removeprefix(prefix): f.file_size or 0 for f in planned})
        snapshot = snapshot_download(ref.repo_id, **args)
    except RevisionNotFoundError:
        raise HubError(ref, f"the repository has no revision {ref.revision!r}") from None
    except GatedRepoError:
        raise HubError(ref, "a gated repository this token may not read") from None
    except RepositoryNotFoundError:
        raise HubError(
            ref, "no such repository on the Hub (or a private one this token may not read)"
        ) from None
    except LocalEntryNotFoundError as e:
        if isinstance(e, IncompleteSnapshotError):
            cached = f"the Hugging Face cache ({cache}) holds part of its files only ({e})"
        else:
            cached = _not_cached(cache, ref)
        if constants.HF_HUB_OFFLINE:
            raise HubError(ref, f"{cached}, and HF_HUB_OFFLINE is set") from None
        raise HubUnavailable(ref, f"{cached}, and the Hub is unreachable") from None
    except (HfHubHTTPError, OSError) as e:  # the Hub's 5xx, a cache that cannot be written
        raise HubUnavailable(ref, f"{type(e).__name__}: {e}") from e
    return Path(snapshot)


def _not_cached(cache: Path, ref: HubRef) -> str:
    revisions = _cached_revisions(cache, ref.repo_id)
    where = f"the Hugging Face cache ({cache})"
    if revisions is None:
        return f"{ref.repo_id} is not in {where}"
    return (
        f"revision {ref.revision or 'main'!r} of {ref.repo_id} is not in {where}, "
        f"which holds {', '.join(revisions) or 'none'}"
    )
