"""The status page (`/`) and its data (`/status.json`) on a real gateway over SmolLM2 in 2
stages (the in-process engine), read over plain HTTP and by a real headless Chromium:
Debian's chromium and chromium-driver (CI installs them with apt-get, .ci/run), driven by
Selenium with both paths given, so nothing is ever downloaded.

The browser test leaves a screenshot at $SKIPPY_TEST_OUT/status_page.png (default
tests/out/). Without Chromium or Selenium it skips, unless SKIPPY_REQUIRE_BROWSER=1 (CI),
where it fails. Run inside a loopback-only network namespace (see the Makefile)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front.gateway import BackgroundServer, create_app

KEY = "status-page-key"  # the operator's: it reads what spans tenants
AUTH = {"Authorization": f"Bearer {KEY}"}
OTHER = {"Authorization": "Bearer another-tenant-key"}  # a tenant: its own figures only
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
WIDTH = 390  # a phone's viewport, in CSS pixels
OUT = Path(os.environ.get("SKIPPY_TEST_OUT", Path(__file__).parent / "out"))
FIGURES = "return [...document.querySelectorAll('[data-metric]')].map(e => " \
          "[e.dataset.metric, e.dataset.value, e.dataset.kind, e.textContent])"


@pytest.fixture(scope="module")
def server(smollm2):
    engine = InProcessEngine(smollm2, 2, cache=CacheConfig(), model_name="smollm2")
    with BackgroundServer(create_app(engine, api_keys=("another-tenant-key",),
                                     operator_keys=(KEY,))) as srv:
        yield srv
    asyncio.run(engine.close())


def scrape(url: str) -> dict[str, float]:
    """/metrics as {series: value}, the series written as the text format writes it."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


# -- plain HTTP -------------------------------------------------------------------------------
def test_the_page_is_public_and_its_data_follows_the_key_rule(server):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<title>skippy-mesh status</title>" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text  # nothing from a CDN
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{server.url}/status.json", headers=headers)
        assert r.status_code == 401
        assert r.json() == {"error": {
            "message": "missing or invalid API key (Authorization: Bearer <key>, or "
                       "x-api-key: <key>)",
            "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
    data = httpx.get(f"{server.url}/status.json", headers=AUTH).json()
    assert data["model"] == "smollm2" and data["serving"] is True
    assert [s["layers"] for s in data["plan"]["stages"]] == [s["layers"] for s in data["stages"]]
    (a, b), (b2, end) = (s["layers"] for s in data["stages"])
    assert a == 0 and b == b2 and end == 30  # SmolLM2's 30 layers, cut once
    for plan in data["plan"]["stages"]:
        assert plan["node"] == "local" and plan["weight_format"] == "fp32"
        assert plan["total_bytes"] == plan["weight_bytes"] + plan["kv_bytes"] > 0
    metrics = scrape(server.url)
    for stage in data["stages"]:
        for k in ("lanes_busy", "lanes_free", "queue_rows", "queue_prefills",
                  "prefill_rows", "decode_rows"):
            assert stage[k]["m"] in metrics, k


def test_a_tenant_sees_only_its_own_requests_in_flight(server):
    body = {"model": "smollm2", "prompt": "Count from one to a hundred: one, two,",
            "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH,
                      timeout=120) as r:
        lines = r.iter_lines()
        next(lines)  # the run has its first token: it is in flight
        theirs = httpx.get(f"{server.url}/status.json", headers=OTHER).json()
        mine = httpx.get(f"{server.url}/status.json", headers=AUTH).json()
        for _ in lines:
            pass
    # runs only leave the list: one in `mine` was in flight when `theirs` was read
    assert len(mine["requests"]) == 1 and mine["requests"][0]["prompt_tokens"] > 5
    assert theirs["requests"] == []


def test_a_tenant_reads_its_own_totals_and_nothing_that_spans_tenants(server):
    """Stage, cache, node and gateway figures count every tenant's work together (a
    dedupe counter would tell one tenant what another sent): an operator key reads them,
    a tenant's key its own runs and totals."""
    def usage(headers):
        return httpx.get(f"{server.url}/status.json", headers=headers).json()["usage"]

    before = usage(OTHER), usage(AUTH)
    body = {"model": "smollm2", "prompt": "The tide comes in", "max_tokens": 3,
            "temperature": 0, "n": 2}
    done = httpx.post(f"{server.url}/v1/completions", json=body, headers=OTHER, timeout=120)
    assert done.status_code == 200, done.text
    theirs = httpx.get(f"{server.url}/status.json", headers=OTHER).json()
    assert theirs["view"] == "tenant" and theirs["model"] == "smollm2" and theirs["serving"]
    assert not set(theirs) & {"plan", "stages", "nodes", "gateway", "errors", "topology"}
    got = done.json()["usage"]
    assert theirs["usage"] == {  # the prompt counted once for its two choices, as usage
        "choices": before[0]["choices"] + 2,
        "prompt_tokens": before[0]["prompt_tokens"] + got["prompt_tokens"],
        "cached_tokens": before[0]["cached_tokens"]
        + got["prompt_tokens_details"]["cached_tokens"],
        "completion_tokens": before[0]["completion_tokens"] + got["completion_tokens"]}
    assert usage(AUTH) == before[1]  # the operator's own totals did not move
    refused = httpx.get(f"{server.url}/metrics", headers=OTHER)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "operator_key_required"
    assert httpx.get(f"{server.url}/status.json", headers=AUTH).json()["view"] == "operator"


# -- a real browser ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install -e '.[test]')")
    if missing:
        why = f"no {', '.join(missing)}: apt-get install -y chromium chromium-driver"
        if os.environ.get("SKIPPY_REQUIRE_BROWSER") == "1":
            pytest.fail(why)
        pytest.skip(why)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--disable-extensions", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        _viewport(driver, 844)
        yield driver
    finally:
        driver.quit()


def _viewport(driver, height: int) -> None:
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": WIDTH, "height": height, "deviceScaleFactor": 2, "mobile": True})


def wait_for(driver, condition, timeout: float = 20.0, what: str = ""):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait
    # an element read while the page re-renders is asked again at the next poll
    return WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=[StaleElementReferenceException]).until(
        lambda d: condition(d), message=what)


def page_value(driver, series: str) -> float | None:
    value = driver.execute_script(
        "const e = [...document.querySelectorAll('[data-metric]')]"
        ".find(e => e.dataset.metric === arguments[0]); return e ? e.dataset.value : null",
        series)
    return None if value is None else float(value)


def polls(driver) -> int:
    return int(driver.execute_script("return document.body.dataset.polls || '0'"))


def no_sideways_scroll(driver) -> None:
    scroll, client, inner = driver.execute_script(
        "const e = document.documentElement; return [e.scrollWidth, e.clientWidth, "
        "window.innerWidth]")
    assert inner == WIDTH and scroll <= client, (scroll, client, inner)


def severe(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver, url: str) -> None:
    """The page with the key already given (as a user who entered it in this tab): the
    key is put in place before the page's own script runs, so its first request has it."""
    script = driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {
        "source": f"sessionStorage.setItem('skippy.apiKey', '{KEY}')"})["identifier"]
    try:
        driver.get(f"{url}/")
    finally:
        driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument",
                               {"identifier": script})
    wait_for(driver, lambda d: len(d.find_elements("css selector", "#stages [data-stage]"))
             == 2, what="the page shows 2 stages")


def run_requests(url: str) -> threading.Thread:
    """Three streams of 40 tokens at once, in a thread."""
    def one(i: int) -> None:
        body = {"model": "smollm2", "prompt": f"Status page test {i}: tell a story",
                "max_tokens": 40, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
        r.raise_for_status()

    def all_three() -> None:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(one, range(3)))
    thread = threading.Thread(target=all_three, daemon=True)
    thread.start()
    return thread


def screenshot(driver, path: Path) -> None:
    """The whole page, at the phone's width."""
    path.parent.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    _viewport(driver, height)
    try:
        driver.save_screenshot(str(path))
    finally:
        _viewport(driver, 844)
    print(f"status page screenshot: {path}")


def test_the_page_shows_the_stages_moves_and_matches_metrics(server, browser):
    d = browser
    open_page(d, server.url)
    assert d.find_element("id", "key").is_displayed() is False
    no_sideways_scroll(d)
    decode = 'skippy_stage_decode_rows_total{stage="1"}'
    busy = ['skippy_stage_lanes_busy{stage="0"}', 'skippy_stage_lanes_busy{stage="1"}']
    before = page_value(d, decode)
    assert before is not None

    # numbers move while requests run
    thread = run_requests(server.url)
    seen, rows_seen, busy_seen, shot = set(), False, False, OUT / "status_page.png"
    shot.unlink(missing_ok=True)
    while thread.is_alive():
        seen.add(page_value(d, decode))
        busy_seen |= any((page_value(d, s) or 0) > 0 for s in busy)
        # read in one script: the page re-renders the table between two element reads
        rows = d.execute_script(
            "return [...document.querySelectorAll('#requests tr[data-request] td:last-child')]"
            ".map(e => e.textContent.trim())")
        if rows:
            no_sideways_scroll(d)  # the in-flight table fits too
            if not shot.exists() and any(r not in ("", "–") for r in rows):
                screenshot(d, shot)  # decoding: rates, TTFT and tokens/s are showing
            rows_seen = True
        time.sleep(0.2)
    thread.join()
    if not shot.exists():  # the requests ended between two refreshes
        screenshot(d, shot)
    assert any(v is not None and v > before for v in seen), (before, seen)
    assert rows_seen and busy_seen
    assert shot.stat().st_size > 10_000

    # with nothing in flight, every figure the page shows is its /metrics value
    idle = ['skippy_gateway_requests_running', *busy,
            'skippy_stage_sessions{stage="0"}', 'skippy_stage_sessions{stage="1"}']
    wait_for(d, lambda d: all(page_value(d, s) == 0 for s in idle)
             and not d.find_elements("css selector", "#requests tr[data-request]"),
             what="the page shows nothing in flight")
    n = polls(d)
    wait_for(d, lambda d: polls(d) >= n + 2, what="two more refreshes")
    first = scrape(server.url)
    figures = d.execute_script(FIGURES)
    second = scrape(server.url)
    assert len(figures) >= 50
    shown = {series for series, *_ in figures}
    for needed in (decode, *busy, 'skippy_stage_cache_hits_total{stage="1"}',
                   'skippy_node_physical_bytes{node="local"}',
                   'skippy_requests_total{endpoint="/v1/completions",status="200"}',
                   "skippy_time_to_first_token_seconds_count"):
        assert needed in shown, needed
    for series, value, kind, text in figures:
        assert first[series] == second[series], f"{series} moved while idle"
        assert float(value) == first[series], (series, value, first[series])
        if kind == "count":
            assert float(text) == first[series], (series, text)
    assert first[decode] > before
    no_sideways_scroll(d)
    assert severe(d) == []


def test_the_page_asks_for_the_key_and_keeps_it_for_the_tab(server, browser):
    d = browser
    d.execute_script("sessionStorage.clear()")  # the tab forgets the key it had
    d.get_log("browser")  # what came before
    d.get(f"{server.url}/")
    wait_for(d, lambda d: d.find_element("id", "key").is_displayed(), what="the key form")
    assert not d.find_element("id", "board").is_displayed()
    no_sideways_scroll(d)

    field = d.find_element("id", "key-input")
    field.send_keys("not-the-key\n")
    wait_for(d, lambda d: "refused" in d.find_element("id", "key-error").text,
             what="a wrong key is refused")
    d.find_element("id", "key-input").send_keys(KEY + "\n")
    wait_for(d, lambda d: len(d.find_elements("css selector", "#stages [data-stage]")) == 2,
             what="the page shows 2 stages once the key is given")
    assert d.execute_script("return sessionStorage.getItem('skippy.apiKey')") == KEY
    # the only errors the browser reports: the two 401s that asked for the key
    errors = severe(d)
    assert len(errors) == 2, errors
    assert all("status.json" in e["message"] and "401" in e["message"] for e in errors)

    # a tenant's key: its own runs and totals, none of the cluster's sections
    d.execute_script("sessionStorage.setItem('skippy.apiKey', 'another-tenant-key')")
    d.get(f"{server.url}/")
    wait_for(d, lambda d: "operator key" in d.find_element("id", "summary").text,
             what="the tenant's view")
    assert d.find_element("id", "usage").is_displayed()
    hidden = d.execute_script("return [...document.querySelectorAll('section.operator')]"
                              ".map(s => s.hidden)")
    assert hidden == [True] * 5, hidden
    no_sideways_scroll(d)
