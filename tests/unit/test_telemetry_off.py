"""Telemetry off costs nothing: building the gateway's parts imports no OpenTelemetry SDK or exporter, and the bus
gets no listener. (A fresh interpreter: the suite's other tests import the SDK.)"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

CHECK = """
import sys
import app.serving.gateway
from app.serving.events import EventBus
from app.serving.telemetry import TelemetryOptions, start_telemetry

bus = EventBus()
assert start_telemetry(TelemetryOptions(enabled=False), bus, "tandem") is None
assert bus.listeners == 0
loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter")))
assert not loaded, loaded
"""


def test_telemetry_off_imports_no_sdk_and_adds_no_listener():
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_otel_sdk_disabled_turns_it_off_even_when_enabled(monkeypatch):
    from app.serving.events import EventBus
    from app.serving.telemetry import TelemetryOptions, start_telemetry

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    bus = EventBus()
    assert start_telemetry(TelemetryOptions(enabled=True), bus, "tandem") is None
    assert bus.listeners == 0
