"""The dashboard in a real browser: headless Chromium (Debian's `chromium` + `chromium-driver`, which `make setup`
installs when it runs as root) driven by Selenium, against a real gateway.

Real parts: `tandem serve` with the real device model (Qwen2.5-Coder-0.5B), a scripted OpenAI-compatible cloud on
loopback that answers first and then breaks or refuses as each test says, the openai SDK as the client whose
requests the page must show (under two API keys: a plain one and a named one with a cap), and Chromium itself.
Every request races (disco-s at b = 1) but the one that starts on the device and moves to a free cloud for cost.
Screenshots go to the test's output folder (printed at the end of the module).

The gateway has OTEL_EXPORTER_OTLP_ENDPOINT pointed at a real OTLP receiver and telemetry off: nothing may arrive.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import httpx
import openai
import pytest
from pydantic import SecretStr
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from app.config import key_label
from app.launcher import GatewayProcess, start_gateway, stop_gateway
from app.serving.limits import to_micro
from tests.integration.browser_helpers import CHROMEDRIVER, CHROMIUM
from tests.integration.otlp_receiver import OTLPReceiver
from tests.integration.scripted_upstream import PIECES, Answer, ScriptedUpstream

API_KEY, TEAM_KEY, ADMIN_KEY = "page-user-key", "page-team-key", "page-admin-key"
# Long enough that the device's prefill takes longer than the scripted cloud's first piece: the cloud wins the race.
SEEN: dict[str, str] = {}  # request ids of earlier tests, for the last screenshot
MESSAGES = [{"role": "user", "content": "Summarise this list: " + ", ".join(f"item {i}" for i in range(40))}]


def fresh(topic: str) -> list[dict]:
    """A prompt the device has not cached: its prefill takes long enough again for the cloud to answer (or fail)
    first (a cached prompt's first device token comes in milliseconds and wins the race)."""
    return [{"role": "user", "content": f"Summarise this {topic} list: " + ", ".join(f"{topic} {i}" for i in range(4))}]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, receiver: OTLPReceiver) -> Iterator[GatewayProcess]:
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_TRACES_EXPORTER": "otlp"}
    with mock.patch.dict(os.environ, otel):
        process = start_gateway(f"""
[gateway]
policy = "disco-s"
api_keys = ["{API_KEY}", {{ key = "{TEAM_KEY}", name = "team-b", cap_usd = 5 }}]
admin_keys = ["{ADMIN_KEY}"]
stall_timeout = 30    # a loaded CI box must not turn a slow device into a fault
[device]
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
budget = 1.0          # disco-s at b = 1: every request races
migration = false     # only faults move answers
profile_device = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
connect_timeout = 2
read_timeout = 3
retries = 0   # a scripted failure is the cloud's one answer: the device takes over
""")
    yield process
    stop_gateway(process)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("dashboard-screenshots")
    yield folder
    print(f"\ndashboard screenshots: {folder}")


@pytest.fixture(scope="module")
def browser(browser_installed: None, gw: GatewayProcess, tmp_path_factory) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(flag)
    with mock.patch.dict(os.environ, {"SE_OFFLINE": "true"}):  # Selenium Manager must not look for a browser
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.get(gw.url + "/dashboard")
    driver.find_element(By.ID, "api-key").send_keys(API_KEY)
    driver.find_element(By.ID, "admin-key").send_keys(ADMIN_KEY)
    driver.find_element(By.ID, "connect").click()
    wait(driver).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "true")
    yield driver
    driver.quit()


def wait(driver, seconds: float = 60) -> WebDriverWait:
    # The page re-renders what it refreshes: an element found in one poll may be replaced before it is read; the
    # next poll finds the new one.
    return WebDriverWait(driver, seconds, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,))


def chat(
    gw: GatewayProcess, max_tokens: int = 8, key: str = API_KEY, messages: list[dict] = MESSAGES, **tandem
) -> tuple[str, str]:
    client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model="tandem",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"tandem": tandem} if tandem else None,
    )
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    return raw.headers["x-request-id"], text


def row_of(driver, request_id: str):
    """The request's row once it shows its outcome."""
    selector = f'#request-rows tr[data-id="{request_id}"]'
    wait(driver).until(
        lambda d: (
            (d.find_elements(By.CSS_SELECTOR, selector) or [None])[0] is not None
            and d.find_element(By.CSS_SELECTOR, selector).get_attribute("data-outcome") != "running"
        )
    )
    return driver.find_element(By.CSS_SELECTOR, selector)


def cells(row) -> dict[str, str]:
    names = ("request", "plan", "winner", "migrations", "ttft", "tokens", "cost", "privacy", "outcome")
    return dict(zip(names, (c.text for c in row.find_elements(By.TAG_NAME, "td")), strict=True))


def open_timeline_by_keyboard(driver, row) -> list:
    driver.execute_script("arguments[0].focus()", row)
    row.send_keys(Keys.ENTER)
    section = driver.find_element(By.ID, "timeline")
    assert driver.switch_to.active_element == section  # focus moved at once to what opened
    lanes = f'#timeline .trace[data-id="{row.get_attribute("data-id")}"] .lane'
    wait(driver).until(lambda d: section.is_displayed() and d.find_elements(By.CSS_SELECTOR, lanes))
    return driver.find_elements(By.CSS_SELECTOR, lanes)


def test_a_race_with_a_fault_migration_appears_live_with_endpoints_tokens_and_timeline(gw, upstream, browser, shots):
    upstream.push(Answer(pieces=PIECES[:4], then="close"))
    request_id, text = chat(gw)
    SEEN["migrated"] = request_id
    assert text.startswith("".join(PIECES[:4]))
    row = row_of(browser, request_id)
    shown = cells(row)
    assert shown["plan"] == "disco-s · race"
    assert shown["winner"] == "cloud → device"  # the cloud won the race; the device took over after the fault
    assert shown["migrations"] == "cloud→device (error)"
    assert shown["tokens"].startswith("cloud: 4, device: ")
    assert shown["outcome"].startswith("finished: ") and shown["privacy"] == "any"
    assert shown["ttft"].endswith("ms") or shown["ttft"].endswith(" s")

    lanes = open_timeline_by_keyboard(browser, row)
    assert [lane.get_attribute("data-outcome") for lane in lanes] == ["failed", "lost", "finished"]
    assert "from token 4" in lanes[2].text
    migration = browser.find_element(By.CSS_SELECTOR, "#timeline .migrations li").text
    assert "cloud → device, error" in migration and "reader" in migration
    assert len(browser.find_elements(By.CSS_SELECTOR, "#timeline .mark.first")) == 2  # cloud's, the device's
    browser.save_screenshot(str(shots / "race-migration-timeline.png"))
    browser.switch_to.active_element.send_keys(Keys.ESCAPE)
    wait(browser).until(lambda d: not d.find_element(By.ID, "timeline").is_displayed())
    assert browser.switch_to.active_element == row  # focus goes back where it came from


def test_a_cost_migration_to_a_cheaper_cloud_appears_with_its_reason_and_timeline(gw, upstream, browser, shots):
    """Under the named key: the answer starts on the device (DiSCo-S at b = 0) and DiSCo moves it to a free cloud for
    cost once the (slow) reader is far enough behind; the cloud continues from the delivered prefix."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    cheap = {
        "migration": True,
        "budget": 0.0,
        "consumption_rate": 1.0,
        "prices": {"cloud": {"prefill": 0.0, "decode": 0.0}},
    }
    assert httpx.put(gw.v1 + "/budget", json=cheap, headers=admin, timeout=10).status_code == 200
    try:
        upstream.push(Answer(pieces=PIECES[:6]))
        request_id, text = chat(gw, max_tokens=16, key=TEAM_KEY, policy="disco-s")
    finally:
        upstream.reset()  # an answer left unasked must not answer the next test's request
        assert httpx.delete(gw.v1 + "/budget", headers=admin, timeout=10).status_code == 200
    SEEN["cost"] = request_id
    assert text.endswith("".join(PIECES[:6]))
    shown = cells(row_of(browser, request_id))
    assert shown["plan"] == "disco-s · device"
    assert shown["winner"] == "device → cloud" and shown["migrations"] == "device→cloud (cost)"
    assert shown["tokens"].startswith("device: ") and shown["tokens"].endswith("cloud: 6")
    assert shown["outcome"].startswith("finished: ")
    lanes = open_timeline_by_keyboard(browser, browser.find_element(By.CSS_SELECTOR, f'tr[data-id="{request_id}"]'))
    assert [lane.get_attribute("data-outcome") for lane in lanes] == ["migrated-from", "finished"]
    assert "cloud from token " in lanes[1].text
    migration = browser.find_element(By.CSS_SELECTOR, "#timeline .migrations li").text
    assert "device → cloud, cost" in migration and "failed" not in migration
    assert len(browser.find_elements(By.CSS_SELECTOR, "#timeline .mark.migration")) == 2  # one per lane
    browser.save_screenshot(str(shots / "cost-migration-timeline.png"))
    browser.switch_to.active_element.send_keys(Keys.ESCAPE)


def test_a_cloud_that_refuses_fails_over_to_the_device(gw, upstream, browser, shots):
    upstream.push(Answer(status=500))
    request_id, text = chat(gw, max_tokens=4, messages=fresh("failing"))
    assert text
    shown = cells(row_of(browser, request_id))
    assert shown["winner"] == "device" and shown["migrations"] == "–"
    assert shown["tokens"].startswith("cloud: 0, device: ") and shown["outcome"].startswith("finished: ")
    lanes = open_timeline_by_keyboard(browser, browser.find_element(By.CSS_SELECTOR, f'tr[data-id="{request_id}"]'))
    assert [lane.get_attribute("data-outcome") for lane in lanes] == ["failed", "finished"]
    assert "scripted 500" in lanes[0].text
    browser.switch_to.active_element.send_keys(Keys.ESCAPE)

    # The endpoint health panel shows both endpoints with their TTFT histograms from /metrics.
    def device_card(d) -> str:  # read inside the wait: the panel's cards are replaced on every refresh (stale)
        text = d.find_element(By.CSS_SELECTOR, '[data-endpoint="device"]').text
        return text if "samples" in text else ""

    device = wait(browser).until(device_card)
    assert "device (device, device)" in device and "ready" in device and "TTFT:" in device
    assert "Inter-token:" in device


def test_spend_per_api_key_is_shown_by_name_never_the_key(gw, browser, shots):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    wait(browser).until(lambda d: "over 3 requests" in d.find_element(By.ID, "budget-facts").text)
    budget = httpx.get(gw.v1 + "/budget", headers=admin, timeout=10).json()
    lines = {k["name"]: k for k in budget["keys"]}
    plain = key_label(SecretStr(API_KEY))  # a key without a name of its own: a short hash of it
    assert set(lines) == {plain, "team-b"}
    # The named key sent one request (the cost migration): its spend is that request's cost; the plain key's is
    # the rest of what the gateway booked (each request's cost rounded to a micro-dollar).
    user = {"Authorization": f"Bearer {TEAM_KEY}"}
    cost = httpx.get(f"{gw.v1}/requests/{SEEN['cost']}", headers=user, timeout=10).json()["cost_usd"]
    assert lines["team-b"]["spent_micro"] == to_micro(cost) > 0 and lines["team-b"]["cap_usd"] == 5
    assert abs(lines[plain]["spent_micro"] - (budget["spend"]["cost_micro"] - to_micro(cost))) <= 3
    assert lines[plain]["spent_micro"] > 0 and lines[plain]["cap_usd"] is None

    def row(name: str) -> dict[str, str]:
        def read(d) -> dict[str, str]:  # inside a wait: the table re-renders as the budget refreshes (stale cells)
            found = d.find_element(By.CSS_SELECTOR, f'#budget-keys tr[data-key="{name}"]')
            heads = [th.text for th in d.find_elements(By.CSS_SELECTOR, "#budget-keys thead th")]
            return dict(zip(heads, (td.text for td in found.find_elements(By.TAG_NAME, "td")), strict=True))

        return wait(browser).until(read)

    wait(browser).until(lambda d: d.find_elements(By.CSS_SELECTOR, '#budget-keys tr[data-key="team-b"]'))
    team, mine = row("team-b"), row(plain)
    assert team["Period"] == "day" and team["Cap"].startswith("$5.0000 (") and "device only" in team["Cap"]
    assert team["Spent"] != "$0" and mine["Spent"] != "$0" and mine["Cap"] == "none"
    assert team["Requests / min"] != "–" and mine["Requests / min"] == "–"  # counted where a limit needs them
    text = browser.find_element(By.ID, "budget").text
    assert API_KEY not in text and TEAM_KEY not in text and API_KEY not in str(budget)
    # The whole page: the three requests, the fault migration's timeline open, the keys' spend (README's screenshot).
    open_timeline_by_keyboard(browser, browser.find_element(By.CSS_SELECTOR, f'tr[data-id="{SEEN["migrated"]}"]'))
    size = browser.get_window_size()
    browser.set_window_size(size["width"], browser.execute_script("return document.documentElement.scrollHeight"))
    try:
        browser.save_screenshot(str(shots / "dashboard.png"))
    finally:
        browser.set_window_size(size["width"], size["height"])
    browser.switch_to.active_element.send_keys(Keys.ESCAPE)


def test_the_budget_is_edited_with_the_admin_key_and_refused_without_it(gw, browser):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    before = httpx.get(gw.v1 + "/budget", headers=admin, timeout=10).json()
    target = browser.find_element(By.ID, "budget-b")
    target.clear()
    target.send_keys("0.35")
    browser.find_element(By.ID, "budget-save").click()
    message = browser.find_element(By.ID, "budget-message")
    wait(browser).until(lambda d: message.text)
    assert message.text.startswith("Saved: b = 0.35")
    after = httpx.get(gw.v1 + "/budget", headers=admin, timeout=10).json()
    assert after["budget"] == 0.35 and after["version"] == before["version"] + 1
    log = "#event-log li"
    wait(browser).until(lambda d: any("budget.changed" in li.text for li in d.find_elements(By.CSS_SELECTOR, log)))

    # With only the API key in the admin field, the gateway refuses and nothing changes.
    admin_field = browser.find_element(By.ID, "admin-key")
    admin_field.clear()
    admin_field.send_keys(API_KEY)
    browser.find_element(By.ID, "connect").click()
    target = browser.find_element(By.ID, "budget-b")
    target.clear()
    target.send_keys("0.9")
    browser.find_element(By.ID, "budget-save").click()
    wait(browser).until(lambda d: message.text.startswith("Refused"))
    assert message.text.startswith("Refused (403)") and "admin key" in message.text
    assert httpx.get(gw.v1 + "/budget", headers=admin, timeout=10).json()["budget"] == 0.35
    admin_field.clear()
    admin_field.send_keys(ADMIN_KEY)
    browser.find_element(By.ID, "connect").click()
    assert httpx.delete(gw.v1 + "/budget", headers=admin, timeout=10).status_code == 200


def test_everything_is_reachable_by_keyboard(browser):
    browser.find_element(By.TAG_NAME, "body").click()
    browser.execute_script("document.activeElement.blur(); window.scrollTo(0, 0)")
    reached = []
    for _ in range(40):
        browser.switch_to.active_element.send_keys(Keys.TAB)
        element = browser.switch_to.active_element
        reached.append(element.get_attribute("id") or element.tag_name + ":" + (element.get_attribute("data-id") or ""))
    for wanted in ("api-key", "admin-key", "connect", "budget-b", "budget-policy", "budget-save"):
        assert wanted in reached, reached
    rows = [r for r in reached if r.startswith("tr:")]
    assert len(rows) >= 2  # every request row is a tab stop
    # Arrow keys move between rows.
    first = browser.find_element(By.CSS_SELECTOR, "#request-rows tr")
    browser.execute_script("arguments[0].focus()", first)
    first.send_keys(Keys.ARROW_DOWN)
    assert browser.switch_to.active_element.get_attribute("data-id") != first.get_attribute("data-id")
    assert browser.execute_script("return getComputedStyle(document.activeElement).outlineStyle") != "none"


def test_the_page_fits_a_phone_width_screen(browser, shots):
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True}
    )
    try:
        time.sleep(0.3)  # layout
        width = browser.execute_script("return window.innerWidth")
        assert width == 390
        assert browser.execute_script("return document.documentElement.scrollWidth") <= width
        for section in browser.find_elements(By.CSS_SELECTOR, "main > section:not([hidden])"):
            box = section.rect
            assert box["x"] >= 0 and box["x"] + box["width"] <= width, section.get_attribute("id")
        # One column: the budget panel is below the request list, not beside it.
        assert browser.find_element(By.ID, "budget").rect["y"] > browser.find_element(By.ID, "requests").rect["y"]
        browser.save_screenshot(str(shots / "phone.png"))
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_with_telemetry_off_no_exporter_runs(gw, receiver):
    """The gateway had OTEL_EXPORTER_OTLP_ENDPOINT set to a live receiver all along and served requests: with
    [telemetry] off, nothing was sent (the requests above finished long before the SDK's 5 s batch delay would
    have passed had an exporter run: the budget and keyboard tests took longer)."""
    assert receiver.posts == 0 and receiver.spans == []


def test_the_page_loads_nothing_from_outside(gw):
    r = httpx.get(gw.url + "/dashboard", timeout=5)
    assert r.status_code == 200 and "default-src 'self'" in r.headers["content-security-policy"]
    assets = ("dashboard.js", "dashboard.css")
    page = r.text + "".join(httpx.get(f"{gw.url}/dashboard/{f}", timeout=5).text for f in assets)
    assert "http://" not in page and "https://" not in page and "//cdn" not in page
    assert httpx.get(gw.url + "/dashboard/../config.py", timeout=5).status_code == 404
    assert shutil.which("chromium") or os.path.exists(CHROMIUM)
