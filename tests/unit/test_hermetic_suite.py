"""The suite is hermetic: what the user did with their own gateway (a budget saved over PUT /v1/budget in their state
folder) changes no test's result. tests/conftest.py moves HOME and the XDG base directories to a folder of the run;
these tests poison the user's real locations, as the README's budget example would, and run tests that read them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from app.config import default_state_file, load_settings
from app.serving.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]
# The README's budget example, as a user's gateway saves it: cloud prices that differ from every test's config.
CLOUD = "[clouds.cloud]\nprice = { prefill_per_million = 2.0, decode_per_million = 8.0 }\n"
POISON = {"budget": 0.3, "exchange_rate": 5, "prices": {"cloud": {"prefill": 0.15, "decode": 0.6}}}


def poisoned_home(tmp_path: Path) -> tuple[Path, Path]:
    """A home whose default state file and whose $XDG_STATE_HOME both hold the README example's saved budget."""
    home, xdg_state = tmp_path / "home", tmp_path / "xdg-state"
    for state_file in (home / ".local/state/tandem/budget.json", xdg_state / "tandem/budget.json"):
        state_file.parent.mkdir(parents=True)
        ledger = Ledger(state_file, load_ledger_defaults(tmp_path))
        ledger.update(POISON)
        assert state_file.exists()
    return home, xdg_state


def load_ledger_defaults(tmp_path: Path):
    config = tmp_path / "defaults.toml"
    config.write_text(f'[gateway]\nstate_file = ""\n{CLOUD}')
    return Ledger.from_settings(load_settings(config)).defaults


def test_the_default_state_file_follows_xdg_state_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_state_file() == str(tmp_path / "tandem" / "budget.json")
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert default_state_file() == str(tmp_path / "h" / ".local/state/tandem/budget.json")


def test_this_run_reads_no_users_state():
    """The suite's own processes: the default state file lies in this run's folder, not under the user's home."""
    home = os.environ["TANDEM_TEST_HOME"]
    assert os.environ["HOME"] == home
    assert Path(default_state_file()).is_relative_to(home)
    for variable in ("XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        assert Path(os.environ[variable]).is_relative_to(home)
    # The read-only caches stay where the user keeps them (the models are not fetched again per run).
    for variable in ("TANDEM_MODEL_DIR", "TANDEM_BIN_DIR", "TANDEM_AGENTS_DIR"):
        assert not Path(os.environ[variable]).is_relative_to(home)


# A module of tests that each need one part or none, run beside the suite's own state-reading tests.
PARTS = """
from tests.integration.store_helpers import server_binary

def test_needs_the_browser(browser_installed):
    pass

def test_needs_the_store():
    server_binary()

def test_needs_neither():
    pass
"""
# Tests of the suite that read the default state file: a saved budget there would change their result.
STATE_READERS = [
    "tests/unit/test_usage_pricing.py::test_the_config_names_the_cached_and_reasoning_prices",
    "tests/unit/test_hermetic_suite.py::test_this_run_reads_no_users_state",
]


def test_a_users_saved_budget_or_a_missing_part_changes_no_other_result(tmp_path):
    """A fresh `pytest` on a machine whose user saved the README example's budget (in ~/.local/state and in
    $XDG_STATE_HOME) and that has neither Chromium nor a Redis-protocol server: the tests that read settings pass (the
    suite moved HOME and the XDG folders; the poison is untouched), the tests that need the browser or the store fail,
    each naming the command that installs it, and every other test runs (no collection error stops the run). The
    same settings loaded outside the suite do read the poison, so it is live."""
    home, xdg_state = poisoned_home(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_TEST_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    env |= {"HOME": str(home), "XDG_STATE_HOME": str(xdg_state)}
    config = tmp_path / "t.toml"
    config.write_text(CLOUD)
    outside = subprocess.run(
        [sys.executable, "-c", f"import app.config as c; print(c.load_settings({str(config)!r}).gateway.state_file)"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(outside.stdout.strip()) == xdg_state / "tandem/budget.json"  # a user's gateway reads the poison

    parts = tmp_path / "test_parts.py"
    parts.write_text(PARTS)
    env |= {
        "PATH": str(tmp_path),  # no valkey-server or redis-server on it
        "TANDEM_TEST_CHROMIUM": str(tmp_path / "no-chromium"),
        "TANDEM_TEST_CHROMEDRIVER": str(tmp_path / "no-chromedriver"),
        "PYTHONPATH": str(ROOT),
    }
    # --noconftest -p tests.conftest: the suite's own set-up without tests/unit's (torch models these tests never use)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-p", "tests.conftest",
         *STATE_READERS, str(parts)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 1, out[-3000:]
    assert "1 failed, 3 passed, 1 error" in out, out[-3000:]
    assert "FAILED" in out and "test_needs_the_store" in out and "ERROR" in out and "test_needs_the_browser" in out
    assert "sudo apt-get install chromium chromium-driver" in out
    assert "sudo apt-get install redis-server" in out
    for state_file in (home / ".local/state/tandem/budget.json", xdg_state / "tandem/budget.json"):
        assert '"prefill": 0.15' in state_file.read_text()  # untouched by the run
