"""``phalanx.client.Client``: the Python client of ``phalanx server``, which the CLI uses too.

from phalanx.client import Client
client = Client()                      # $PHALANX_URL and $PHALANX_TOKEN, else what `phalanx login` saved
job = client.submit(open("job.yaml").read(), priority=10)
for text in client.follow_logs(job["id"]):
    print(text, end="")
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx


class ClientError(Exception):
    """The server refused a request (``status``, with its ``detail``), or could not be reached (status 0)."""

    def __init__(self, status: int, detail: Any):
        self.status, self.detail = status, detail
        super().__init__(_describe(status, detail))


def _describe(status: int, detail: Any) -> str:
    if isinstance(detail, list):  # validation errors: one line per field
        lines = []
        for issue in detail:
            loc = [str(p) for p in issue.get("loc", []) if p not in ("body",)]
            lines.append(f"{'.'.join(loc) or '(request)'}: {issue.get('msg', issue)}")
        return "\n".join(lines)
    return str(detail)


def config_path() -> Path:
    return Path(os.environ.get("PHALANX_CONFIG", Path.home() / ".config" / "phalanx" / "credentials.json"))


def save_login(url: str, token: str) -> Path:
    """Keep the server's URL and a token for later commands, readable by this user only."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "token": token}, f)
    return path


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout_s: float = 30.0):
        saved: dict[str, str] = {}
        if (url or os.environ.get("PHALANX_URL")) is None or (token or os.environ.get("PHALANX_TOKEN")) is None:
            try:
                saved = json.loads(config_path().read_text())
            except (OSError, ValueError):
                saved = {}
        self.url = (url or os.environ.get("PHALANX_URL") or saved.get("url") or "").rstrip("/")
        token = token or os.environ.get("PHALANX_TOKEN") or saved.get("token")
        if not self.url or not token:
            raise ClientError(0, "no server: run `phalanx login URL`, or set PHALANX_URL and PHALANX_TOKEN")
        self._http = httpx.Client(
            base_url=self.url + "/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise ClientError(0, f"cannot reach the server at {self.url}: {e}") from e
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ClientError(response.status_code, detail)
        return response.json()

    # --- who and where
    def whoami(self) -> dict[str, Any]:
        return self._call("GET", "/whoami")

    def tenants(self) -> list[dict[str, Any]]:
        return self._call("GET", "/tenants")

    def create_tenant(
        self,
        name: str,
        nominal_gpus: int,
        cohort: str | None = None,
        borrowing_limit: int | None = None,
        monthly_budget: float | None = None,
    ):
        body = {
            "name": name, "nominal_gpus": nominal_gpus, "cohort": cohort, "borrowing_limit": borrowing_limit,
            "monthly_budget": monthly_budget,
        }  # fmt: skip
        return self._call("POST", "/tenants", json=body)

    def update_tenant(self, name: str, **changes: Any) -> dict[str, Any]:
        return self._call("PATCH", f"/tenants/{name}", json=changes)

    def users(self) -> list[dict[str, Any]]:
        return self._call("GET", "/users")

    def create_user(self, name: str, role: str, tenant: str | None = None) -> dict[str, Any]:
        return self._call("POST", "/users", json={"name": name, "role": role, "tenant": tenant})

    def tokens(self) -> list[dict[str, Any]]:
        return self._call("GET", "/tokens")

    def create_token(
        self,
        name: str = "default",
        user: str | None = None,
        expires_in_s: float = 90 * 86400,
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """A new token; its ``token`` field is shown this once. ``tenant``: the user's, for an admin naming a user
        two tenants have."""
        body = {"name": name, "user": user, "tenant": tenant, "expires_in_s": expires_in_s}
        return self._call("POST", "/tokens", json=body)

    def revoke_token(self, token_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/tokens/{token_id}")

    # --- jobs
    def submit(
        self,
        spec: str | None,
        priority: int = 0,
        tenant: str | None = None,
        workdir: str | None = None,
        resume_from: str | None = None,
    ) -> dict[str, Any]:
        """Queue a job spec (YAML text); relative paths in it are relative to ``workdir`` (default: here).
        ``resume_from``: a job that ended, whose checkpoints the new one goes on from (``spec`` None: its spec,
        and its directory)."""
        where = workdir or (None if spec is None else os.getcwd())
        body = {"spec": spec, "priority": priority, "tenant": tenant, "workdir": where, "resume_from": resume_from}
        return self._call("POST", "/jobs", json=body)

    def jobs(
        self, states: list[str] | None = None, tenant: str | None = None, owner: str | None = None
    ) -> list[dict[str, Any]]:
        params = {"state": states or [], "tenant": tenant, "owner": owner}
        return self._call("GET", "/jobs", params={k: v for k, v in params.items() if v is not None})

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/jobs/{job_id}/cancel")

    def events(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{job_id}/events")

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/jobs/{job_id}/metrics")

    def story(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{job_id}/story")

    def goodput(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{job_id}/goodput")

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/jobs/{job_id}/checkpoints")

    def logs(
        self, job_id: str, rank: int = 0, offset: int = 0, execution: int | None = None, supervisor: bool = False
    ) -> dict[str, Any]:
        """A chunk of a rank's log, or with ``supervisor`` of the supervisor's (its lines, progress, summary)."""
        params: dict[str, Any] = {"rank": rank, "offset": offset, "supervisor": supervisor}
        if execution is not None:
            params["execution"] = execution
        return self._call("GET", f"/jobs/{job_id}/logs", params=params)

    def follow_logs(self, job_id: str, rank: int = 0, poll_s: float = 0.5, supervisor: bool = False) -> Iterator[str]:
        """A rank's log (or the supervisor's) as it is written, until the job ends: the latest execution's, then
        each new one's (after a preemption or a lost execution the job runs again, in a new run directory)."""
        execution, offset = None, 0
        while True:
            chunk = self.logs(job_id, rank, offset, execution, supervisor)
            execution, offset = chunk["execution"], chunk["next_offset"]
            if chunk["text"]:
                yield chunk["text"]
            elif chunk["latest"] != execution:
                execution, offset = chunk["latest"], 0
            elif chunk["job_ended"]:
                return
            else:
                time.sleep(poll_s)

    def cluster(self) -> dict[str, Any]:
        return self._call("GET", "/cluster")

    def quota(self) -> list[dict[str, Any]]:
        return self._call("GET", "/quota")

    def usage(self, since: float = 0.0) -> dict[str, Any]:
        return self._call("GET", "/usage", params={"since": since})

    def spend(self) -> dict[str, Any]:
        return self._call("GET", "/spend")

    def speeds(self) -> dict[str, Any]:
        return self._call("GET", "/speeds")
