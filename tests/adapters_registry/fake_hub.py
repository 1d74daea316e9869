"""A stand-in for the Hugging Face Hub's HTTP API on loopback, for the one path an offline cache
cannot show: what registration does while the Hub answers (there is no network here).

It answers the calls huggingface_hub's `snapshot_download` makes, as the Hub answers them: a
revision's commit (`/api/models/<repo>/revision/<rev>`), the tree at a commit, and each file's
HEAD (commit, ETag, size) and GET under `/<repo>/resolve/<commit>/<path>`; an unknown repository
or revision is the Hub's 404 with its error code. Each repository is one commit of a local folder,
at branch `main`. It records every file GET, so a test can tell what was downloaded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = {
            repo: {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
                   if p.is_file()}
            for repo, folder in repos.items()
        }  # fmt: skip
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.downloads: list[str] = []  # "<repo>/<path>" of every file GET
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        parts = [unquote(p) for p in urlsplit(req.path).path.strip("/").split("/")] + ["", ""]
        api = parts[:2] == ["api", "models"]
        if api:  # /api/models/<org>/<name>/<revision|tree>/<revision>[/<path>]
            parts = parts[2:]
        repo, action, revision, path = "/".join(parts[:2]), parts[2], parts[3], "/".join(parts[4:])
        path = path.strip("/")
        if repo not in self.repos:
            return self._send(req, 404, {"X-Error-Code": "RepoNotFound"}, b"{}", body)
        files, commit = self.repos[repo], self.commits[repo]
        if revision not in ("main", commit):
            return self._send(req, 404, {"X-Error-Code": "RevisionNotFound"}, b"{}", body)
        if api and action == "revision":
            info = {"id": repo, "sha": commit, "siblings": [{"rfilename": f} for f in files]}
            return self._send(req, 200, {}, json.dumps(info).encode(), body)
        if api and action == "tree":
            tree = [
                {
                    "type": "file",
                    "path": f,
                    "size": len(data),
                    "oid": hashlib.sha1(data).hexdigest(),
                }
                for f, data in sorted(files.items())
                if f.startswith(path)
            ]
            return self._send(req, 200, {}, json.dumps(tree).encode(), body)
        if action == "resolve" and path in files:
            data = files[path]
            if body:
                self.downloads.append(f"{repo}/{path}")
            etag = f'"{hashlib.sha256(data).hexdigest()}"'
            return self._send(req, 200, {"X-Repo-Commit": commit, "ETag": etag}, data, body)
        return self._send(req, 404, {"X-Error-Code": "EntryNotFound"}, b"{}", body)

    @staticmethod
    def _send(
        req: BaseHTTPRequestHandler, status: int, headers: dict[str, str], data: bytes, body: bool
    ) -> None:
        req.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            req.send_header(key, value)
        req.end_headers()
        if body:
            req.wfile.write(data)
