"""The dashboard in a real browser: headless Chromium (Debian's package) driven by Playwright, against
`phalanx server` on loopback. Log in with a token, submit a job from the page, watch its progress move with
no reload, see the restart `phalanx chaos kill` causes appear, and never see another tenant's job, in the
page or in anything the page received. Screenshots of each page go to the test's temporary directory."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, unavailable
from servers import PhalanxServer
from test_platform import tiny, wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
def browser() -> Iterator:
    from playwright import sync_api  # a dev dependency; the browser is Debian's

    if not Path(CHROMIUM).is_file():
        unavailable("Chromium is not installed: apt-get install chromium (.ci/run does)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"] if os.geteuid() == 0 else [])
        yield browser
        browser.close()


def _steps(page) -> int:
    found = re.search(r"step (\d+)", page.locator("#job-progress").inner_text())
    return int(found.group(1)) if found else 0


def _until(check, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not so after {timeout} s"
        time.sleep(0.2)


def test_watch_a_job_live_and_see_only_your_tenant(server: PhalanxServer, browser, tmp_path: Path) -> None:
    alice = server.member("vision", 2, "alice")
    bob = server.member("audio", 2, "bob")
    hidden = bob.submit(tiny("audio-secret", 5) + "kind: audio-secret-kind\n")["id"]  # its kind: audio's too
    wait_for(bob, hidden, {"SUCCEEDED"})  # done: the two slots are alice's
    token = server.admin.create_token("browser", "alice")["token"]

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    received: list[str] = []  # every API answer and live message the page got
    page.on("response", lambda r: received.append(r.text()) if "/api/v1/" in r.url else None)
    page.on("websocket", lambda ws: ws.on("framereceived", lambda frame: received.append(str(frame))))

    page.goto(server.url)  # redirected to the dashboard, which asks for a token
    page.fill("#token", "phx_000000000000_wrong")
    page.click("#login")
    page.wait_for_selector("#login-error:has-text('not valid')")
    page.fill("#token", token)
    page.click("#login")
    page.wait_for_selector("#jobs-table")
    assert "alice (member, vision)" in page.inner_text("#who")

    page.fill("#submit-spec", tiny("ui-job", 100_000, every=20))
    page.click("#submit")
    link = page.wait_for_selector("#submit-result a")
    job = link.inner_text()
    page.wait_for_selector(f"tr[data-job='{job}'] td.state:has-text('RUNNING')", timeout=120_000)
    page.evaluate("window.__notReloaded = true")  # gone if the page ever reloads

    link.click()
    page.wait_for_selector("#job-progress:has-text('step')", timeout=120_000)
    first = _steps(page)
    _until(lambda: _steps(page) > first + 3)  # the page moves by itself
    wait_for(alice, job, {"RUNNING"}, steps=25)  # a checkpoint (step 20) to restart from
    (run,) = (server.tmp / "data" / "jobs" / job / "attempt-1" / "runs" / "ui-job").iterdir()
    chaos = [sys.executable, "-m", "phalanx", "chaos", str(run), "kill", "--rank", "1"]
    subprocess.run(chaos, check=True, capture_output=True, cwd=REPO, timeout=120)
    page.wait_for_selector("#restarts li[data-cause='killed']", timeout=120_000)
    page.wait_for_selector("#timeline td:has-text('attempt 1 began')", timeout=120_000)  # in a sentence
    resumed = _steps(page)
    _until(lambda: _steps(page) > resumed + 3)  # and trains on
    (restart,) = alice.story(job)["restarts"]  # `phalanx status` tells it: the cause, the step it went on from
    assert restart["category"] == "killed" and not restart["in_process"] and restart["execution"] == 1
    assert restart["resumed_from"] >= 20 and restart["resumed_from"] % 20 == 0, restart  # a checkpoint's step
    page.wait_for_selector("#log:has-text('step')")  # rank 0's log, followed
    assert page.locator("#goodput span[data-category='productive']").count() == 1
    card = {k: page.inner_text(f"#summary [data-field='{k}'] b") for k in ("outcome", "last loss", "restarts")}
    assert card["outcome"] == "RUNNING" and float(card["last loss"]) > 0 and card["restarts"] == "1", card
    page.wait_for_selector("#per-rank tr[data-rank='1']")  # each rank's own memory, from its heartbeats
    memory = [page.inner_text(f"#per-rank tr[data-rank='{r}'] td[data-label='peak memory']") for r in (0, 1)]
    assert all(re.fullmatch(r"[\d.]+ [MG]iB", m) and float(m.split()[0]) > 0 for m in memory), memory
    assert page.inner_text("#per-rank tr[data-rank='1'] td[data-label='GPU busy']") == "no GPU"
    assert page.locator("#chart-mfu.empty").count() == 1  # on a CPU: it says why instead of empty axes
    said = page.evaluate("getComputedStyle(document.querySelector('#chart-mfu'), '::before').content")
    assert "peak FLOPs are not known" in said, said
    # against the step by default, the restart a break in the line, and a click puts the charts against time
    assert page.locator("#chart-loss .u-label:has-text('step')").count() >= 1
    xs, losses = page.evaluate("document.querySelector('#chart-loss').plot.data")
    assert None in losses and xs == sorted(xs) and xs[0] == 1, xs[:5]
    page.click("#time-axis")
    assert page.evaluate("document.querySelector('#chart-loss').plot.data[0][0]") > 1e9  # Unix time
    assert "name: ui-job" in page.text_content("#spec")  # the resolved spec
    page.fill("#log-search", "step")  # the log's lines that have it
    lines = page.inner_text("#log").strip().splitlines()
    assert lines and all("step" in line for line in lines), lines[:3]
    assert page.evaluate("window.__notReloaded") is True
    page.screenshot(path=tmp_path / "job.png", full_page=True)

    page.click("#nav-fleet")
    page.wait_for_selector("#tenants tr[data-tenant='vision']")
    assert "slots in use" in page.inner_text("#capacity")  # --slots: CPU slots, called so
    page.wait_for_selector("#spend tr[data-tenant='vision']")  # this month's spend: no prices given, $0
    assert page.inner_text("#spend tr[data-tenant='vision'] td[data-label='monthly budget']") == "none"
    page.wait_for_selector("#speeds tr[data-kind='llama-tiny-seq32'] td.fastest")  # alice's kind, one type
    page.screenshot(path=tmp_path / "fleet.png", full_page=True)
    assert page.locator("#tenants tr[data-tenant='audio']").count() == 0
    assert page.locator("#spend tr[data-tenant='audio']").count() == 0
    assert page.locator("#speeds tr[data-kind='audio-secret-kind']").count() == 0

    page.goto(f"{server.url}/ui/#/jobs/{hidden}")  # another tenant's job, by its id
    page.wait_for_selector("main .error:has-text('not found')")
    not_found = f"job {hidden!r} not found"  # all the page may learn of it: the key it asked for, not found
    assert page.inner_text("main .error") == not_found  # the channel's close reason, shown as it came
    page.click("#nav-jobs")
    page.wait_for_selector(f"tr[data-job='{job}'] td.restarts:has-text('1')")
    page.screenshot(path=tmp_path / "jobs.png", full_page=True)
    assert page.locator(f"tr[data-job='{hidden}']").count() == 0
    leaked = [t for t in received if hidden in t.replace(not_found, "") or '"audio"' in t or "audio-secret-kind" in t]
    assert not leaked, leaked[:2]
    assert any(job in text for text in received)  # the positive control: the page did receive alice's job

    # on a laptop and at a phone's width no page scrolls sideways: at 390 px tables become cards, charts shrink
    pages = [("job", f"#/jobs/{job}", "#summary [data-field='outcome']"), ("fleet", "#/fleet", "#tenants tbody tr"),
             ("jobs", "#/jobs", f"tr[data-job='{job}']")]  # fmt: skip
    for width, height in ((1440, 900), (390, 844)):
        page.set_viewport_size({"width": width, "height": height})
        for name, where, ready in pages:
            page.goto(f"{server.url}/ui/{where}")
            page.wait_for_selector(ready)
            if name == "job":  # read as the page opens: the periodic checkpoints, each verified
                page.wait_for_selector("#checkpoints tr[data-step] td:has-text('ok')")
            page.wait_for_timeout(500)  # the charts follow their boxes' width
            wide = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert wide <= 0, f"{where} scrolls {wide} px sideways at {width} px"
            page.screenshot(path=tmp_path / f"{width}-{name}.png", full_page=True)
    page.check(f"tr[data-job='{job}'] input.pick")  # runs side by side: the loss against the step
    page.click("#compare")
    page.wait_for_function("document.querySelector('#chart-compare')?.plot?.data[1]?.some((v) => v > 0)")
    assert page.evaluate("document.querySelector('#chart-compare').plot.series[1].label") == job
    page.screenshot(path=tmp_path / "compare.png", full_page=True)
    for name in ("jobs.png", "job.png", "fleet.png", "390-jobs.png", "compare.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    alice.cancel(job)
    wait_for(alice, job, {"CANCELLED"}, timeout=120)


def test_utilisation_is_each_spans_most_and_mean() -> None:
    """The fleet's chart against a count every tenth of a second: a burst shorter than a span shows in its most
    (a sample at one moment of the span would miss it), and the mean is the held GPU-time over the span."""
    from types import SimpleNamespace

    from phalanx.control.server.dashboard import UTILISATION_POINTS, _utilisation

    runs = [SimpleNamespace(started_at=s, ended_at=e, gpus=g) for s, e, g in
            ((-100.0, None, 2), (130.0, 150.0, 4), (200.0, 260.0, 1), (60.0, 60.5, 8))]  # fmt: skip
    got = _utilisation(runs, 0.0, UTILISATION_POINTS * 60.0)  # spans of 60 s
    for span in range(UTILISATION_POINTS):
        times = [span * 60 + i / 10 for i in range(600)]
        held = [sum(r.gpus for r in runs if r.started_at <= t < (r.ended_at or 1e18)) for t in times]
        assert got["max"][span] == max(held), span
        assert abs(got["mean"][span] - sum(held) / len(held)) < 0.05, span
    assert got["max"][1] == 10  # the half-second burst
