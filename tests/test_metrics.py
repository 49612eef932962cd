"""`/metrics` for real: a job runs under `phalanx server`, a rank is killed with `phalanx chaos`, and a real
Prometheus (Debian's package) scraping the server on loopback sees the job's series, its restart by cause,
and the tenant's quota, through its HTTP API. The same scrape, as another tenant, shows none of it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, unavailable
from servers import PhalanxServer, Prometheus
from test_platform import tiny, wait_for


def _scrape(server: PhalanxServer, token: str) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert response.status_code == 200, response.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def _until(prometheus: Prometheus, expr: str, timeout: float = 90) -> list[dict]:
    """The query's result once a scrape has it (the first can take several seconds)."""
    deadline = time.monotonic() + timeout
    while not (found := prometheus.query(expr)):
        assert time.monotonic() < deadline, f"{expr}: nothing after {timeout} s; up: {prometheus.query('up')}"
        time.sleep(0.5)
    return found


def test_prometheus_scrapes_a_jobs_series_and_its_restart(server: PhalanxServer, tmp_path: Path) -> None:
    client = server.member("vision", 2, "erin")
    server.member("audio", 2, "fay")
    token = tmp_path / "erin.token"
    token.write_text(server.admin.create_token("prometheus", "erin")["token"])
    try:
        prometheus = Prometheus(tmp_path, f"127.0.0.1:{server.port}", token)
    except FileNotFoundError as e:
        unavailable(str(e))
    try:
        job = client.submit(tiny("watched", 100_000, every=20))["id"]  # runs until cancelled
        wait_for(client, job, {"RUNNING"}, steps=25)  # a checkpoint (step 20) to restart from
        (run,) = (server.tmp / "data" / "jobs" / job / "attempt-1" / "runs" / "watched").iterdir()
        chaos = [sys.executable, "-m", "phalanx", "chaos", str(run), "kill", "--rank", "1"]
        subprocess.run(chaos, check=True, capture_output=True, cwd=REPO, timeout=120)
        labels = f'tenant="vision",job_id="{job}",execution="1"'
        restarts = _until(prometheus, f'phalanx_job_restarts_total{{{labels},cause="killed"}}')
        assert float(restarts[0]["value"][1]) == 1.0
        (step,) = _until(prometheus, f"phalanx_job_last_step{{{labels}}}")
        assert float(step["value"][1]) >= 21  # at least the checkpoint's step, resumed from
        _until(prometheus, f"rate(phalanx_job_steps_total{{{labels}}}[1m]) > 0")  # a counter: it rates
        # once the next attempt trains, the counter holds the steps run again after the restart (one scrape)
        _until(prometheus, f"phalanx_job_steps_total{{{labels}}} - phalanx_job_last_step{{{labels}}} > 0")
        for name in (
            "phalanx_job_step_seconds",
            "phalanx_job_tokens_per_second",
            "phalanx_job_goodput_ratio",
            "phalanx_job_tokens_total",
            "phalanx_job_loss",
            "phalanx_job_last_step_timestamp_seconds",
        ):
            (sample,) = prometheus.query(f"{name}{{{labels}}}")
            assert float(sample["value"][1]) > 0, name
        (info,) = prometheus.query(f'phalanx_job_info{{job_id="{job}"}}')
        assert info["metric"]["name"] == "watched" and info["metric"]["owner"] == "erin"
        assert prometheus.query('phalanx_http_request_duration_seconds_count{route="/api/v1/jobs/{job_id}"}')
        assert prometheus.query("phalanx_scheduler_round_seconds_count")
        assert prometheus.query("process_cpu_seconds_total")
        (quota,) = prometheus.query('phalanx_tenant_nominal_gpus{tenant="vision"}')
        assert quota["value"][1] == "2"
        assert not prometheus.query('phalanx_tenant_nominal_gpus{tenant="audio"}')  # erin's token sees vision only
        # every series the Grafana dashboard (docs/grafana/phalanx.json) asks for is one the server exports
        text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {token.read_text()}"}).text
        exported = {n for f in text_string_to_metric_families(text) for n in (f.name, *(s.name for s in f.samples))}
        grafana = json.loads((REPO / "docs" / "grafana" / "phalanx.json").read_text())
        exprs = [t["expr"] for p in grafana["panels"] for t in p["targets"]]
        exprs.append((REPO / "docs" / "grafana" / "alerts.yml").read_text())  # and so does every alert rule
        asked = {n for expr in exprs for n in re.findall(r"(?:phalanx|process)_\w+", expr)}
        assert asked and asked <= exported, asked - exported
        checked = subprocess.run(["promtool", "check", "rules", str(REPO / "docs" / "grafana" / "alerts.yml")],
                                 capture_output=True, text=True)  # fmt: skip
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        prometheus.stop()

    # another tenant's scrape shows none of it; once the job ended, its series stay a while (their last values
    # are scraped) and the counts say how it ended
    elsewhere = _scrape(server, server.admin.create_token("scrape", "fay")["token"])
    assert not [k for k in elsewhere if "vision" in dict(k[1]).values() or job in dict(k[1]).values()]
    client.cancel(job)
    wait_for(client, job, {"CANCELLED"}, timeout=120)
    seen = _scrape(server, server.admin.create_token("scrape", "erin")["token"])
    ended = (("execution", "1"), ("job_id", job), ("tenant", "vision"))
    assert seen[("phalanx_job_steps_total", ended)] > 0  # lingering: LINGER_S after the execution ended
    assert seen[("phalanx_jobs_ended_total", (("state", "CANCELLED"), ("tenant", "vision")))] == 1
    assert ("phalanx_jobs", (("state", "CANCELLED"), ("tenant", "vision"))) not in seen  # no ever-growing gauge
    assert seen[("phalanx_admission_latency_seconds_count", (("tenant", "vision"),))] == 1
