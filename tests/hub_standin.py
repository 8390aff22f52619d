"""A stand-in for the Hugging Face hub (it cannot be reached from here): a local HTTP server with
the routes `huggingface_hub` 2.4's `snapshot_download` calls, serving repositories from local
folders. Tests point `HF_ENDPOINT` at it; it records every request (with its Authorization header)
so a test can tell whether a second resolve downloaded anything and which token was sent.

Routes: `GET /api/{models,datasets}/<id>[/revision/<rev>]` (repo info: sha, siblings),
`GET /api/{models,datasets}/<id>/tree/<rev>` (the recursive file listing), and
`HEAD|GET /[datasets/]<id>/resolve/<rev>/<file>` with X-Repo-Commit, ETag and Content-Length.
An unknown repository is a 404 with `X-Error-Code: RepoNotFound`, as the hub answers.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class Repo:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        digest = hashlib.sha1()
        for name in self.files:
            digest.update(name.encode() + (folder / name).read_bytes())
        self.sha = digest.hexdigest()

    def blob_id(self, name: str) -> str:
        return hashlib.sha1((self.folder / name).read_bytes()).hexdigest()


class HubStandIn:
    """Repositories by (kind, id), kind "model" or "dataset"; `requests` logs (method, path,
    Authorization header or "")."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.url = ""

    def add(self, kind: str, repo_id: str, folder: Path) -> None:
        self.repos[(kind, repo_id)] = Repo(folder)

    def downloads(self) -> list[str]:
        return [p for m, p, _ in self.requests if m == "GET" and "/resolve/" in p]


def _handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _not_found(self, code: str = "RepoNotFound") -> None:
            self._send(404, b'{"error": "not found"}', {"X-Error-Code": code})

        def _json(self, value: object) -> None:
            self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

        def _api(self, parts: list[str]) -> None:
            kind = {"models": "model", "datasets": "dataset"}.get(parts[0], "")
            repo_id, rest = "/".join(parts[1:3]), parts[3:]
            repo = hub.repos.get((kind, repo_id))
            if repo is None:
                return self._not_found()
            if not rest or rest[0] == "revision":
                if rest[1:] and rest[1] not in ("main", repo.sha):
                    return self._not_found("RevisionNotFound")
                return self._json(
                    {
                        "id": repo_id,
                        "sha": repo.sha,
                        "private": False,
                        "siblings": [{"rfilename": f} for f in repo.files],
                    }
                )
            if rest[0] == "tree":
                return self._json(
                    [
                        {
                            "type": "file",
                            "path": f,
                            "size": (repo.folder / f).stat().st_size,
                            "oid": repo.blob_id(f),
                        }
                        for f in repo.files
                    ]
                )
            return self._not_found("EntryNotFound")

        def _resolve(self, parts: list[str]) -> None:
            kind = "dataset" if parts[0] == "datasets" else "model"
            parts = parts[1:] if kind == "dataset" else parts
            repo = hub.repos.get((kind, "/".join(parts[:2])))
            if repo is None:
                return self._not_found()
            name = "/".join(parts[4:])
            if parts[3] not in ("main", repo.sha) or name not in repo.files:
                return self._not_found("EntryNotFound")
            body = (repo.folder / name).read_bytes()
            self._send(
                200,
                body,
                {"X-Repo-Commit": repo.sha, "ETag": f'"{repo.blob_id(name)}"'},
            )

        def do_GET(self) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Authorization", "")))
            parts = [p for p in path.split("/") if p]
            if parts and parts[0] == "api":
                self._api(parts[1:])
            elif "resolve" in parts:
                self._resolve(parts)
            else:
                self._not_found("EntryNotFound")

        do_HEAD = do_GET

    return Handler


@contextmanager
def hub_standin() -> Iterator[HubStandIn]:
    """A running stand-in on a free loopback port; `hub.url` is its HF_ENDPOINT."""
    hub = HubStandIn()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
