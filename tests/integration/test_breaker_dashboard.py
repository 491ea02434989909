"""The dashboard shows a cloud's circuit breaker (issue 39, item 4): open while the cloud cools after a 429 with a long
`Retry-After`, with when it ends and after what error.

Real parts: `tandem serve` with the small Qwen device model, a scripted OpenAI-compatible cloud on loopback sending a
real 429 with the header, and headless Chromium (Debian's `chromium` + `chromium-driver`) driven by Selenium.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from unittest import mock

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.browser_helpers import CHROMEDRIVER, CHROMIUM
from tests.integration.scripted_upstream import Answer, ScriptedUpstream

API_KEY = "breaker-page-key"
MESSAGES = [{"role": "user", "content": "Name one prime number."}]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
policy = "disco-s"
api_keys = ["{API_KEY}"]
stall_timeout = 30
[device]
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
budget = 1.0
migration = false
profile_device = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
connect_timeout = 2
read_timeout = 10
retry_budget_seconds = 1
""")
    yield process
    stop_gateway(process)


@pytest.fixture(scope="module")
def browser(browser_installed: None, gw: GatewayProcess, tmp_path_factory) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tmp_path_factory.mktemp("chromium-profile")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=1280,1000"):
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    with mock.patch.dict(os.environ, {"SE_OFFLINE": "true"}):  # Selenium Manager must not look for a browser
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.get(gw.url + "/dashboard")
    driver.find_element(By.ID, "api-key").send_keys(API_KEY)
    driver.find_element(By.ID, "connect").click()
    WebDriverWait(driver, 60, poll_frequency=0.1).until(
        lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "true"
    )
    yield driver
    driver.quit()


def breaker_line(driver) -> tuple[str, str] | None:
    # Read in one script: the card is re-rendered every refresh, so an element found by one WebDriver call can be
    # gone (stale) by the next.
    line = driver.execute_script(
        "const e = document.querySelector('[data-endpoint=\"cloud\"] [data-breaker]');"
        "return e ? [e.getAttribute('data-breaker'), e.innerText] : null;"
    )
    return tuple(line) if line else None


def test_the_endpoint_card_shows_the_cloud_cooling_and_then_closed(gw, upstream, browser):
    wait = WebDriverWait(browser, 60, poll_frequency=0.2)
    wait.until(lambda d: (breaker_line(d) or ("", ""))[0] == "closed")  # a cloud's card has its breaker
    # Longer than the 1 s retry budget, and than any wait for the page's refresh (every 5 s) on a loaded machine: the
    # cloud cools for an hour, so the card cannot miss it.
    upstream.push(Answer(status=429, retry_after="3600"))
    auth = {"authorization": f"Bearer {API_KEY}"}
    body = {"model": "tandem", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=auth, timeout=120)
    assert r.status_code == 200 and r.headers["x-tandem-backend"] == "device", r.text
    _, text = wait.until(lambda d: (line := breaker_line(d)) and line[0] == "open" and line)
    assert text.startswith("breaker open: cooling until ") and "answered 429" in text
    # A success closes the breaker (a pinned answer goes to the cloud whatever its state), and the card follows.
    r = httpx.post(gw.v1 + "/chat/completions", json={**body, "model": "cloud"}, headers=auth, timeout=120)
    assert r.status_code == 200 and r.headers["x-tandem-backend"] == "cloud", r.text
    wait.until(lambda d: (breaker_line(d) or ("", ""))[0] == "closed")
