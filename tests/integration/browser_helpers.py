"""The browser the dashboard's tests drive: Debian's chromium through its chromedriver (nothing downloads a browser
of its own). Without them only the tests that need a browser fail, each with the line that installs it; the rest of
the suite runs (a check at import would stop the whole collection)."""

from __future__ import annotations

import os

import pytest

# Debian's paths; the variables exist so that a test can show what a machine without them does.
CHROMIUM = os.environ.get("TANDEM_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("TANDEM_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")
INSTALL = "sudo apt-get install chromium chromium-driver"


def require_browser() -> None:
    """Fail the calling test (a named, visible reason, never a silent pass) when the browser is missing."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(path)]
    if missing:
        pytest.fail(
            f"the dashboard's browser tests need {' and '.join(missing)}: {INSTALL} (make setup does it as root)",
            pytrace=False,
        )
