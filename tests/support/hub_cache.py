"""A Hugging Face Hub cache on local disk, laid out as huggingface_hub writes it, for offline
tests (HF_HUB_OFFLINE=1; there is no network here):

    <cache>/models--<org>--<name>/blobs/<hash>               file contents, one per distinct file
    <cache>/models--<org>--<name>/snapshots/<commit>/<path>  relative links to ../../blobs/<hash>
    <cache>/models--<org>--<name>/refs/<branch>              the branch's commit hash
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_repo(cache: Path, repo_id: str, source: Path, branch: str = "main") -> str:
    """Put every file of folder `source` into `cache` as a commit of `repo_id` that `branch`
    points at; returns the commit hash."""
    files = sorted(p for p in source.rglob("*") if p.is_file() and not p.name.startswith("."))
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode() + b"".join(p.name.encode() for p in files)).hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for file in files:
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = repo / "snapshots" / commit / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return commit
