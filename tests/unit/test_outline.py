"""Outline decoding's pure parts: the gate, the outline parser, placing points by predicted finish time."""

from __future__ import annotations

import pytest

from policies.outline import MAX_POINTS, assign, gate, parse_outline

LIST = "What are some tips for sleeping better?"


@pytest.mark.parametrize(
    ("question", "turns", "tokens", "plain", "use", "says"),
    [
        (LIST, 1, 400, True, True, "list-style"),
        ("Write a Python function that reverses a list.", 1, 400, True, False, "code"),
        ("Fix this bug: `x = foo()`", 1, 400, True, False, "code"),
        ("Solve 3x + 4 = 19 for x.", 1, 400, True, False, "math"),
        ("What is the probability of two sixes?", 1, 400, True, False, "math"),
        (LIST, 2, 400, True, False, "follow-up"),
        (LIST, 1, 60, True, False, "short"),
        (LIST, 1, 400, False, False, "tools"),
        ("Tell me about the moon.", 1, 400, True, False, "not a list-style"),
    ],
)
def test_the_auto_gate(question, turns, tokens, plain, use, says):
    verdict = gate("auto", turns, question, tokens, plain)
    assert verdict.use is use and says in verdict.reason


def test_outline_mode_skips_only_the_list_test_and_sequential_never_uses_it():
    assert gate("outline", 1, "Tell me about the moon.", 400, True).use
    assert not gate("outline", 1, "Implement quicksort in Rust.", 400, True).use
    assert not gate("sequential", 1, LIST, 400, True).use


@pytest.mark.parametrize(
    ("text", "points"),
    [
        ("1. Sleep early\n2. Dim the lights\n3. No coffee", ["Sleep early", "Dim the lights", "No coffee"]),
        (
            "Here is an outline:\n- **Routine**: same hours\n* Dark room\n• Cool air",
            ["Routine: same hours", "Dark room", "Cool air"],
        ),
        ("1) One\n\n   2) Two:\nsome prose in between\n(3) Three", ["One", "Two", "Three"]),
        ("a. first\nb) second", ["first", "second"]),
        ("Just one paragraph, no list at all.", None),
        ("1. Only one point", None),
    ],
)
def test_outlines_numbered_bulleted_and_messy(text, points):
    assert parse_outline(text) == points


def test_an_outline_keeps_at_most_max_points():
    text = "\n".join(f"{i}. point {i}" for i in range(1, 15))
    assert len(parse_outline(text)) == MAX_POINTS


def test_points_go_where_they_finish_first():
    # The cloud writes 4× faster: it gets four points for each of the device's.
    where = assign(10, 40, {"device": 10.0, "cloud": 40.0}, {})
    assert where.count("cloud") == 8 and where.count("device") == 2
    # Equal rates alternate (ties to the first listed); a busy endpoint starts later.
    assert assign(4, 40, {"device": 10.0, "cloud": 10.0}, {}) == ["device", "cloud", "device", "cloud"]
    assert assign(2, 40, {"device": 10.0, "cloud": 10.0}, {"device": 10.0}) == ["cloud", "cloud"]


def test_an_endpoint_with_lanes_runs_that_many_points_side_by_side():
    # A 2-stage worker (two lanes) at the device's rate takes two points for each of the device's ...
    where = assign(6, 40, {"device": 10.0, "hat": 10.0}, {}, {"hat": 2})
    assert where == ["device", "hat", "hat", "device", "hat", "hat"]
    # ... and at half the device's rate, as many as the device: each lane finishes a point when the device does two.
    where = assign(8, 40, {"device": 10.0, "hat": 5.0}, {}, {"hat": 2})
    assert where.count("hat") == 4 and where.count("device") == 4
    # One lane is the default: the same placement as without lanes.
    assert assign(5, 40, {"device": 10.0, "cloud": 30.0}, {}, {"cloud": 1}) == assign(
        5, 40, {"device": 10.0, "cloud": 30.0}, {}
    )


def test_bench_pins_device_and_cloud_to_separate_cores_one_thread_each() -> None:
    import tomllib

    from app.config import embedded_default
    from app.tools.bench.outline_bench import pinned

    cfg = tomllib.loads(pinned(embedded_default().read_text(), 0, 1))
    assert cfg["device"]["n_threads"] == 1
    embedded = cfg["clouds"]["cloud"]["embedded"]
    assert (embedded["n_threads"], embedded["cpus"]) == (1, [1])
    assert cfg["clouds"]["hat"] == tomllib.loads(embedded_default().read_text())["clouds"]["hat"]
    with pytest.raises(ValueError, match=r"clouds\.cloud\.embedded"):
        pinned("[device]\nn_threads = 2\n", 0, 1)
