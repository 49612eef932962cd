"""The REST API in-process (FastAPI's test client over the real app and a real SQLite store): every endpoint x
role x tenant, authentication, bad input, and a fuzz of the whole API from its OpenAPI schema.

Over 400 lines on purpose: the route matrix, the hostile bodies and the fuzz check one table of routes, kept
in one place so that a new route cannot be missed by any of them."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from urllib.parse import unquote

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from sqlalchemy import select
from starlette.websockets import WebSocketDisconnect

from phalanx.control.server import auth
from phalanx.control.server.app import MAX_BODY, create_app
from phalanx.control.server.deps import Server
from phalanx.control.server.main import bootstrap
from phalanx.control.store import Execution, Job, Role, Token, open_store
from phalanx.spec import excerpt

SPEC = "name: t\nresources: {procs_per_node: 1, device: cpu}\ncommand: [python, -c, pass]\n"
TENANTS = ("alpha", "beta")
ROLES = (Role.TENANT_ADMIN, Role.MEMBER, Role.VIEWER)


class World:
    """Tenants alpha and beta, each with a user of every role and a job with a run directory (logs, events,
    metrics); tokens for everyone."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.store = open_store(f"sqlite:///{tmp / 'phalanx.db'}")
        self.admin = bootstrap(self.store)
        self.app = create_app(Server(self.store, tmp / "jobs", {"gpu": 8}, lambda: None))
        self.http = TestClient(self.app, raise_server_exceptions=False)
        self.tokens: dict[str, str] = {"admin": self.admin}
        self.token_ids: dict[str, str] = {}
        for tenant in TENANTS:
            self.call("admin", "POST", "/tenants", json={"name": tenant, "nominal_gpus": 4}, expect=201)
            for role in ROLES:
                user = f"{tenant}-{role}"
                self.call("admin", "POST", "/users", json={"name": user, "role": role, "tenant": tenant}, expect=201)
                made = self.call("admin", "POST", "/tokens", json={"user": user}, expect=201)
                self.tokens[user], self.token_ids[user] = made["token"], made["id"]
        self.jobs = {t: self._job(t, tmp) for t in TENANTS}

    def _job(self, tenant: str, tmp: Path) -> str:
        job = self.call(f"{tenant}-member", "POST", "/jobs", json={"spec": SPEC}, expect=201)
        run = tmp / "runs" / tenant
        (run / "logs").mkdir(parents=True)
        (run / "logs" / "rank-0.log").write_text(f"secret log line of {tenant}\n")
        (run / "logs" / "rank-0.stacks.txt").write_text(f'File "train.py", line 1, in secret stack of {tenant}\n')
        (run / "events.jsonl").write_text(json.dumps({"ts": 1.0, "kind": "run_started", "who": tenant}) + "\n")
        (run / "metrics.jsonl").write_text(json.dumps({"ts": 2.0, "step": 0, "loss": 1.0, "who": tenant}) + "\n")
        with self.store.write() as s:
            row = s.scalar(select(Job).where(Job.id == job["id"]))
            s.add(Execution(job=row.seq, tenant=tenant, attempt=1, gpus=1, started_at=1.0, run_dir=str(run)))
        return job["id"]

    def call(self, who: str, method: str, path: str, expect: int | None = None, **kwargs):
        response = self.http.request(
            method, _url(path), headers={"Authorization": f"Bearer {self.tokens[who]}"}, **kwargs
        )
        if expect is not None:
            assert response.status_code == expect, (method, path, response.status_code, response.text)
        return response.json()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("api"))


def _requests(w: World, tenant: str) -> dict[tuple[str, str], tuple[str, dict]]:
    """Per endpoint: a request for ``tenant``'s things (path filled in, body or query)."""
    job = w.jobs[tenant]
    return {
        ("GET", "/api/v1/whoami"): ("/whoami", {}),
        ("GET", "/api/v1/tenants"): ("/tenants", {}),
        ("POST", "/api/v1/tenants"): ("/tenants", {"json": {"name": f"{tenant}-2", "nominal_gpus": 1}}),
        ("GET", "/api/v1/tenants/{name}"): (f"/tenants/{tenant}", {}),
        ("PATCH", "/api/v1/tenants/{name}"): (f"/tenants/{tenant}", {"json": {"nominal_gpus": 4}}),
        ("GET", "/api/v1/users"): ("/users", {}),
        ("POST", "/api/v1/users"): (
            "/users",
            {"json": {"name": f"x{time.time_ns()}", "role": "viewer", "tenant": tenant}},
        ),
        ("GET", "/api/v1/tokens"): ("/tokens", {}),
        ("POST", "/api/v1/tokens"): ("/tokens", {"json": {"user": f"{tenant}-viewer"}}),
        ("DELETE", "/api/v1/tokens/{token_id}"): (f"/tokens/{w.token_ids[f'{tenant}-viewer']}", {}),
        ("POST", "/api/v1/jobs"): ("/jobs", {"json": {"spec": SPEC, "tenant": tenant}}),
        ("GET", "/api/v1/jobs"): ("/jobs", {"params": {"tenant": tenant}}),
        ("GET", "/api/v1/jobs/{job_id}"): (f"/jobs/{job}", {}),
        ("POST", "/api/v1/jobs/{job_id}/cancel"): (f"/jobs/{job}/cancel", {}),
        ("GET", "/api/v1/jobs/{job_id}/logs"): (f"/jobs/{job}/logs", {}),
        ("GET", "/api/v1/jobs/{job_id}/events"): (f"/jobs/{job}/events", {}),
        ("GET", "/api/v1/jobs/{job_id}/metrics"): (f"/jobs/{job}/metrics", {}),
        ("GET", "/api/v1/jobs/{job_id}/goodput"): (f"/jobs/{job}/goodput", {}),
        ("GET", "/api/v1/jobs/{job_id}/story"): (f"/jobs/{job}/story", {}),
        ("GET", "/api/v1/jobs/{job_id}/checkpoints"): (f"/jobs/{job}/checkpoints", {}),
        ("GET", "/api/v1/cluster"): ("/cluster", {}),
        ("GET", "/api/v1/quota"): ("/quota", {}),
        ("GET", "/api/v1/usage"): ("/usage", {}),
        ("GET", "/api/v1/spend"): ("/spend", {}),
        ("GET", "/api/v1/speeds"): ("/speeds", {}),
        ("GET", "/metrics"): ("/metrics", {}),
        ("GET", "/api/v1/dashboard/jobs"): ("/dashboard/jobs", {}),
        ("GET", "/api/v1/dashboard/jobs/{job_id}"): (f"/dashboard/jobs/{job}", {}),
        ("GET", "/api/v1/dashboard/fleet"): ("/dashboard/fleet", {}),
    }


def _url(path: str) -> str:
    """Routes are under /api/v1, but for Prometheus' /metrics."""
    return path if path.startswith("/metrics") else "/api/v1" + path


def _routes(w: World) -> set[tuple[str, str]]:
    """Every route the API documents, as (method, path)."""
    return {(method.upper(), path) for path, ops in w.app.openapi()["paths"].items() for method in ops}


# What a request names a thing by (a path parameter or a body's or query's field), and the thing's kind.
KINDS = {
    "job_id": "job", "resume_from": "job", "name": "tenant", "token_id": "token", "tenant": "tenant", "user": "user",
}  # fmt: skip


def _asked(route: str, path: str, kwargs: dict) -> dict[str, object]:
    """The keys a request of ``route`` at ``path`` names things by: its path parameters, body and query fields."""
    pattern = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", route.removeprefix("/api/v1"))
    body = kwargs.get("json")
    return {
        **re.fullmatch(pattern, path).groupdict(),
        **(body if isinstance(body, dict) else {}),
        **kwargs.get("params", {}),
    }


def _not_found(asked: dict[str, object]) -> set[str]:
    """All a 404 may say: that a thing the request named is not found, by the very key it was named by."""
    return {f"{KINDS[field]} {excerpt(key)} not found" for field, key in asked.items() if field in KINDS}


def _leaks(response, w: World, tenant: str, asked: dict[str, object]) -> list[str]:
    """What of ``tenant`` shows in a response: its name, users, job, log line, events or metrics. A 404 may
    only say that a thing the request named (``asked``) is not found, or that the route is (FastAPI's own)."""
    if response.status_code == 404:
        detail = response.json().get("detail")
        return [] if detail in _not_found(asked) | {"Not Found"} else [str(detail)]
    text = response.text
    marks = [
        f'"{tenant}"', f"{tenant}-member", w.jobs[tenant], f"secret log line of {tenant}", f'"who": "{tenant}"',
        f"secret stack of {tenant}",
    ]  # fmt: skip
    return [m for m in marks if m in text.replace('":"', '": "')]


# What an endpoint answers a caller of the right tenant, by role: the positive control of the matrix.
ADMIN_ONLY = {("POST", "/api/v1/tenants"), ("PATCH", "/api/v1/tenants/{name}")}
WRITES = {("POST", "/api/v1/users"), ("POST", "/api/v1/tokens"), ("DELETE", "/api/v1/tokens/{token_id}")}
SUBMIT_CANCEL = {("POST", "/api/v1/jobs"), ("POST", "/api/v1/jobs/{job_id}/cancel")}


def _own_status(endpoint: tuple[str, str], role: Role) -> set[int]:
    if endpoint in ADMIN_ONLY:
        return {403}
    if endpoint == ("POST", "/api/v1/tokens"):  # a token for the tenant's viewer: its own, or a tenant-admin's
        return {201} if role in (Role.TENANT_ADMIN, Role.VIEWER) else {403}
    if endpoint in WRITES:
        return {200, 201} if role is Role.TENANT_ADMIN else {403}
    if endpoint in SUBMIT_CANCEL:
        return {200, 201, 409} if role is not Role.VIEWER else {403}
    return {200}


@pytest.mark.parametrize("role", ROLES)
def test_every_endpoint_hides_another_tenant(world: World, role: Role) -> None:
    """For each endpoint: a caller of alpha is served alpha's things by its role, and gets 404 (never 403,
    never data) for beta's; listings never show beta."""
    assert set(_requests(world, "beta")) == _routes(world), "an endpoint is missing from this matrix"
    caller = f"alpha-{role}"
    for endpoint, (path, kwargs) in _requests(world, "beta").items():
        method = endpoint[0]
        response = world.http.request(
            method, _url(path), headers={"Authorization": f"Bearer {world.tokens[caller]}"}, **kwargs
        )
        asked = _asked(endpoint[1], path, kwargs)
        assert not _leaks(response, world, "beta", asked), (endpoint, role, response.text)
        has_target = "{" in endpoint[1] or "tenant" in kwargs.get("json", {}) or "user" in kwargs.get("json", {})
        if endpoint in ADMIN_ONLY and "{" not in endpoint[1]:
            assert response.status_code == 403, (endpoint, role, response.text)
        elif has_target:  # beta's thing, by the key asked for: nothing more
            assert response.status_code == 404, (endpoint, role, response.status_code, response.text)
            assert response.json()["detail"] in _not_found(asked), (endpoint, role, response.text)
        else:
            assert response.status_code == 200, (endpoint, role, response.text)
    for endpoint, (path, kwargs) in _requests(world, "alpha").items():
        if endpoint == ("DELETE", "/api/v1/tokens/{token_id}"):
            continue  # revoking alpha-viewer's token would end this matrix for that role
        response = world.http.request(
            endpoint[0], _url(path), headers={"Authorization": f"Bearer {world.tokens[caller]}"}, **kwargs
        )
        assert response.status_code in _own_status(endpoint, role), (endpoint, role, response.text)


def test_admin_sees_every_tenant(world: World) -> None:
    assert {t["name"] for t in world.call("admin", "GET", "/tenants", expect=200)} >= set(TENANTS)
    assert world.call("admin", "GET", f"/jobs/{world.jobs['beta']}/logs", expect=200)["text"] == (
        "secret log line of beta\n"
    )


def test_every_request_needs_a_valid_token(world: World) -> None:
    for endpoint, (path, kwargs) in _requests(world, "alpha").items():
        for headers in ({}, {"Authorization": "Bearer nonsense"}, {"Authorization": "Bearer phx_" + "0" * 12 + "_x"}):
            response = world.http.request(endpoint[0], _url(path), headers=headers, **kwargs)
            assert response.status_code == 401, (endpoint, headers, response.text)
    made = world.call("alpha-member", "POST", "/tokens", json={"name": "short", "expires_in_s": 1}, expect=201)
    world.http.headers["Authorization"] = f"Bearer {made['token']}"
    try:
        assert world.http.get("/api/v1/whoami").status_code == 200
        time.sleep(1.1)
        assert world.http.get("/api/v1/whoami").status_code == 401  # expired
        revoked = world.call("alpha-member", "POST", "/tokens", json={"name": "gone"}, expect=201)
        world.call("alpha-member", "DELETE", f"/tokens/{revoked['id']}", expect=200)
        world.http.headers["Authorization"] = f"Bearer {revoked['token']}"
        assert world.http.get("/api/v1/whoami").status_code == 401
    finally:
        world.http.headers.pop("Authorization")
    with world.store.read() as s:  # only hashes are stored
        assert made["token"].split("_", 2)[2] not in {t.secret_sha256 for t in s.scalars(select(Token))}
        assert s.get(Token, made["id"]).secret_sha256 == auth.digest(made["token"].split("_", 2)[2])


def test_bad_input_gets_a_4xx_with_a_message(world: World) -> None:
    member = {"Authorization": f"Bearer {world.tokens['alpha-member']}"}
    for spec, fields in (
        ("name: t\ntrain: {steps: -3}\nresources: {procs_per_node: 0}\n", {"train.steps", "resources.procs_per_node"}),
        ("name: t\ntrain: {model: {preset: nope}}\n", {"train.model.preset"}),  # the checks `phalanx run` makes
        ("name: t\ntrain: {}\ndata: {sources: [{path: no/such/data}]}\n", {"data.sources.0.path"}),
    ):
        bad = world.http.post("/api/v1/jobs", headers=member, json={"spec": spec, "workdir": str(world.tmp)})
        assert bad.status_code == 422, bad.text
        assert {".".join(d["loc"]) for d in bad.json()["detail"]} == {f"body.spec.{f}" for f in fields}, bad.text
    huge = world.http.post("/api/v1/jobs", headers=member, json={"spec": "x" * (MAX_BODY + 1)})
    assert huge.status_code == 413 and huge.text == "Content Too Large"  # FastAPI's own limit, before parsing
    malformed = world.http.post("/api/v1/jobs", headers={**member, "content-type": "application/json"}, content="{")
    assert malformed.status_code == 422
    too_big = world.http.post(
        "/api/v1/jobs", headers=member, json={"spec": SPEC.replace("procs_per_node: 1", "procs_per_node: 9")}
    )
    assert too_big.status_code == 422 and "the cluster has 8" in too_big.text
    world.app.state.server.shares = False  # an executor of whole GPUs only (Slurm's)
    share = SPEC.replace("procs_per_node: 1", "procs_per_node: 1, gpu_fraction: 0.5")
    try:
        whole_only = world.http.post("/api/v1/jobs", headers=member, json={"spec": share})
    finally:
        world.app.state.server.shares = True
    assert whole_only.status_code == 422, whole_only.text
    (issue,) = whole_only.json()["detail"]
    assert issue["loc"] == ["body", "spec", "resources", "gpu_fraction"] and "whole GPUs only" in issue["msg"], issue
    hostile = world.http.post(
        "/api/v1/jobs", headers=member, json={"spec": "a: &a [*a, *a, *a, *a, *a, *a, *a, *a]\n" * 3}
    )
    assert hostile.status_code == 422
    assert world.http.get("/api/v1/jobs/nope", headers=member).json() == {"detail": "job 'nope' not found"}
    assert (
        world.http.post(
            f"/api/v1/jobs/{world.jobs['alpha']}/cancel",
            headers={"Authorization": f"Bearer {world.tokens['alpha-viewer']}"},
        ).status_code
        == 403
    )


def _broken_datasets(root: Path) -> dict[str, Path]:
    """Dataset directories whose index.json is wrong in each way a hand-edited or foreign file can be."""
    sha = "0" * 64
    indexes = {
        "not JSON": "{format: phalanx",
        "not an object": "[1, 2]",
        "fields missing": '{"format": "phalanx-tokens-v1"}',
        "a shard outside": json.dumps(
            {"format": "phalanx-tokens-v1", "dtype": "<u2", "vocab_size": 10, "eos_id": 0,
             "shards": [{"file": "../../../etc/passwd", "tokens": 1, "sha256": sha}]}
        ),
        "wrong types": json.dumps(
            {"format": "phalanx-tokens-v1", "dtype": "float64", "vocab_size": "many", "eos_id": -1, "shards": {}}
        ),
    }  # fmt: skip
    found = {}
    for i, (what, text) in enumerate(indexes.items()):
        (root / f"ds{i}").mkdir(parents=True, exist_ok=True)
        (root / f"ds{i}" / "index.json").write_text(text)
        found[what] = root / f"ds{i}"
    return found


def _data_spec(path: Path | str) -> str:
    return f"name: t\ntrain: {{}}\ndata: {{sources: [{{path: '{path}'}}]}}\n"


# JSON a client can send that Python's parser takes but a model, or the answer echoing it, cannot.
HOSTILE_JSON = ["NaN", "-Infinity", "1e400", '"\\ud800"', '"a\\udfff"', "null", "9" * 5000, "[" * 200 + "]" * 200]


def test_hostile_bodies_get_a_short_4xx_naming_what_is_wrong(world: World) -> None:
    from test_responsive import HOSTILE

    member = {"Authorization": f"Bearer {world.tokens['alpha-member']}", "content-type": "application/json"}
    admin = {**member, "Authorization": f"Bearer {world.tokens['admin']}"}
    for raw, where in (
        ('{"spec": "x", "priority": NaN}', "NaN is not a JSON number"),
        ('{"spec": "x", "priority": 1e400}', "out of range for a number"),
        ('{"spec": "\\ud800"}', "lone UTF-16 surrogate"),
        ('{"\\ud800": 1}', "lone UTF-16 surrogate"),
        ("[" * 10_000 + "]" * 10_000, "nested more than"),
    ):
        answer = world.http.post("/api/v1/jobs", headers=member, content=raw)
        assert answer.status_code == 422 and where in answer.text and len(answer.content) < 1024, answer.text
    null_quota = world.http.patch("/api/v1/tenants/alpha", headers=admin, content='{"nominal_gpus": null}')
    assert null_quota.status_code == 422 and null_quota.json()["detail"][0]["loc"] == ["body", "nominal_gpus"]
    echoed = world.http.post("/api/v1/jobs", headers=member, json={"spec": "x", "priority": "p" * 500_000})
    assert echoed.status_code == 422 and len(echoed.content) < 1024  # the input echoed, cut to an excerpt
    for name, spec in HOSTILE.items():
        answer = world.http.post("/api/v1/jobs", headers=member, json={"spec": spec, "workdir": str(world.tmp)})
        assert answer.status_code == 422 and len(answer.content) < 4096, (name, answer.status_code, len(answer.content))
    for what, path in _broken_datasets(world.tmp / "broken").items():
        answer = world.http.post("/api/v1/jobs", headers=member, json={"spec": _data_spec(path)})
        assert answer.status_code == 422, (what, answer.text)
        (issue,) = answer.json()["detail"]
        assert issue["loc"] == ["body", "spec", "data", "sources", "0", "path"] and "index.json" in issue["msg"], what


def test_each_tenant_names_its_own_users(world: World) -> None:
    """beta's tenant-admin creates a user with the name of one of alpha's: created, not a 409 that would
    confirm alpha has it; each tenant sees its own. An admin naming it must say which tenant's."""
    made = world.call("beta-tenant-admin", "POST", "/users", json={"name": "alpha-viewer", "role": "viewer"})
    assert made == {**made, "name": "alpha-viewer", "tenant": "beta"}
    again = world.http.post(
        "/api/v1/users",
        headers={"Authorization": f"Bearer {world.tokens['beta-tenant-admin']}"},
        json={"name": "alpha-viewer", "role": "viewer"},
    )
    assert again.status_code == 409 and "in tenant beta" in again.text  # its own tenant's: that it may know
    assert "alpha-viewer" in {u["name"] for u in world.call("alpha-tenant-admin", "GET", "/users", expect=200)}
    ambiguous = world.http.post(
        "/api/v1/tokens", headers={"Authorization": f"Bearer {world.admin}"}, json={"user": "alpha-viewer"}
    )
    assert ambiguous.status_code == 422 and "tenants alpha, beta: name its tenant" in ambiguous.text
    token = world.call("admin", "POST", "/tokens", json={"user": "alpha-viewer", "tenant": "beta"}, expect=201)
    world.http.headers["Authorization"] = f"Bearer {token['token']}"
    try:
        assert world.http.get("/api/v1/whoami").json()["tenant"] == "beta"
        assert world.http.get(f"/api/v1/jobs/{world.jobs['alpha']}").status_code == 404
    finally:
        world.http.headers.pop("Authorization")


def test_no_token_lives_longer_than_the_server_allows(world: World) -> None:
    """Every role, admins too: a token asks for at most the server's maximum lifetime, and never for none."""
    for who in ("admin", "alpha-tenant-admin", "alpha-member"):
        for expires in (366 * 86400, None):
            answer = world.http.post(
                "/api/v1/tokens",
                headers={"Authorization": f"Bearer {world.tokens[who]}"},
                json={"name": "forever", "expires_in_s": expires},
            )
            assert answer.status_code == 422 and "expires_in_s" in answer.text, (who, expires, answer.text)
    made = world.call("alpha-member", "POST", "/tokens", json={"name": "year", "expires_in_s": 365 * 86400})
    assert made["expires_at"] - made["created_at"] == pytest.approx(365 * 86400)


def test_fuzz_hostile_values_anywhere_in_a_body(tmp_path: Path) -> None:
    """Every body a client can send (POST and PATCH), with one of its values, or the spec, replaced by hostile
    input: non-finite numbers, lone surrogates, nulls, deep nesting, huge numbers; specs with alias bombs,
    over-long path components and broken dataset indexes. As the admin (the deepest reach): never a 5xx,
    never an answer over 8 KiB, never beta's things."""
    from test_responsive import HOSTILE

    w = World(tmp_path)
    broken = _broken_datasets(tmp_path / "broken")
    specs = [*HOSTILE.values(), *(_data_spec(p) for p in broken.values()), _data_spec("d" * 256)]
    bodies = [
        (method, route, path, body)
        for (method, route), (path, kwargs) in _requests(w, "alpha").items()
        if (body := kwargs.get("json")) is not None
    ]
    headers = {"Authorization": f"Bearer {w.tokens['admin']}", "content-type": "application/json"}

    @given(st.sampled_from(bodies), st.data())
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(request, data) -> None:
        method, route, path, body = request
        key = data.draw(st.sampled_from(sorted(body)), label="key")
        if key == "spec" and data.draw(st.booleans(), label="a hostile spec"):
            raw = json.dumps({**body, key: data.draw(st.sampled_from(specs), label="spec")})
        else:
            raw = json.dumps({**body, key: "@@"}).replace('"@@"', data.draw(st.sampled_from(HOSTILE_JSON)))
        answer = w.http.request(method, _url(path), headers=headers, content=raw)
        assert answer.status_code < 500 and len(answer.content) < 8192, (method, path, raw[:200], answer.text[:500])
        try:
            sent = json.loads(raw)
        except ValueError:  # a number too long for Python's int: the API refuses it too, naming nothing
            sent = body
        assert not _leaks(answer, w, "beta", _asked(route, path, {"json": sent})), (method, path, answer.text)

    fuzz()


def test_fuzz_finds_no_500_and_no_leak(tmp_path: Path) -> None:
    """Requests generated from the OpenAPI schema, valid and not, some aimed at beta's job, tenant and token,
    as alpha's tenant-admin (the most a tenant's token can do): never a 5xx, and nothing of beta in any
    answer."""
    w = World(tmp_path)
    schema = schemathesis.openapi.from_asgi("/openapi.json", w.app)
    beta = {"job_id": w.jobs["beta"], "name": "beta", "token_id": w.token_ids["beta-viewer"]}
    headers = {"Authorization": f"Bearer {w.tokens['alpha-tenant-admin']}"}
    seen: set[tuple[str, str, int]] = set()
    for method, path in sorted(_routes(w)):  # each operation in turn: every one is exercised
        operation = schema[path][method.lower()]
        strategies = [operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)]
        if aimed := {k: v for k, v in beta.items() if "{" + k + "}" in path}:
            strategies.append(operation.as_strategy(path_parameters=aimed))

        @given(st.one_of(strategies))
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case) -> None:
            case.headers = {**(case.headers or {}), **headers}  # authenticated: what a tenant's token reaches
            response = case.call()
            seen.add((case.method, case.operation.path, response.status_code))
            where = (case.method, case.formatted_path, case.query, case.body)
            assert response.status_code < 500, (*where, response.text)
            asked = {  # path parameters come percent-encoded; the server decodes them
                **{k: unquote(str(v)) for k, v in (case.path_parameters or {}).items()},
                **(case.query or {}),
                **(case.body if isinstance(case.body, dict) else {}),
            }
            assert not _leaks(response, w, "beta", asked), (*where, response.text)

        fuzz()
    assert {(m, p) for m, p, _ in seen} == _routes(w)
    assert {code for *_, code in seen} >= {200, 201, 404, 422}


def test_the_live_channel_checks_the_token_and_the_tenant(world: World) -> None:
    """The dashboard's WebSocket: a view of one's own tenant comes at once; another tenant's job is not found
    (4404), a bad token is refused (4401), and the jobs view never shows another tenant."""
    with world.http.websocket_connect("/api/v1/dashboard/live") as ws:
        ws.send_json({"token": world.tokens["alpha-viewer"], "view": "jobs"})
        seen = ws.receive_json()
    assert world.jobs["alpha"] in [j["id"] for j in seen["jobs"]] and {j["tenant"] for j in seen["jobs"]} == {"alpha"}
    with world.http.websocket_connect("/api/v1/dashboard/live") as ws:
        ws.send_json({"token": world.tokens["alpha-viewer"], "view": "job", "id": world.jobs["alpha"]})
        shown = ws.receive_json()
    assert shown["job"]["tenant"] == "alpha" and shown["ranks"] == [0]
    assert "secret stack of alpha" in shown["stacks"]["0"]  # a hang's stack dump, for the job page
    for ask, code in (
        ({"token": world.tokens["alpha-tenant-admin"], "view": "job", "id": world.jobs["beta"]}, 4404),
        ({"token": "phx_000000000000_nope", "view": "jobs"}, 4401),
        ({"token": world.tokens["alpha-member"], "view": "everything"}, 4422),
    ):  # fmt: skip
        with world.http.websocket_connect("/api/v1/dashboard/live") as ws:
            ws.send_json(ask)
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_json()
        assert closed.value.code == code, ask
