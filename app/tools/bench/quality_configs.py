"""`tandem bench quality`'s configurations: how each row is asked, the configuration a user gets as shipped (read from
deploy/embedded.toml and policies/, never typed here), the bench's gateway config made from it, and each row's
standing in the report.

The report half reports what a user gets: the endpoints alone, the embedded default's policy and the `quality` policy
at their shipped knobs (`--configs shipped`). Any other row asked there is labelled "exploration (in-sample)": it was
chosen after the report half could be seen, so it is not a held-out result. A new default is chosen on the tune half
(`--half tune`), committed to deploy/ or policies/, and only then reported.
"""

from __future__ import annotations

import copy
import json
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.config import DeviceSettings, DiscoSettings, GatewaySettings, embedded_default
from app.tools.bench.quality_scores import ENDPOINTS
from policies.quality import DEFAULT_THRESHOLD, check_threshold

ADMIN_KEY = "quality-bench-admin"  # the bench's own gateway, on loopback: PUT /v1/budget sets DiSCo's b
NO_PROMPT_CACHE = {"prompt_cache_mb": 0, "prompt_cache_disk_mb": 0}  # see gateway_config
OVERRIDDEN_N_CTX = 4096  # a model other than the shipped one (a test's small model): HumanEval needs < 1,500 tokens

RESULT = "shipped default (held out)"
EXPLORATION = "exploration (in-sample)"
FORMER = "shipped default when committed (held out; the config has changed since)"
BOUND = "bound (oracle router)"
REFERENCE = "reference (coin-flip router at a shipped row's share)"
OTHER_HALVES = {"tune": "tune half", "all": "all problems (tune half included)"}
APPENDIX_D = "Appendix D (forced migrations, both halves)"
ORACLE = "oracle router"


@dataclass(frozen=True)
class Config:
    """One way of answering: its name is its row and its folder in the cache."""

    name: str
    kind: str  # "endpoint" | "disco" | "random" | "forced" | "policy"
    endpoint: str | None = None  # endpoint: the one asked; forced: where the answer starts
    budget: float | None = None  # disco: b
    share: float | None = None  # random: the probability of the cloud
    cut: int = 0  # forced: the answer token after which it moves (0: none)
    options: tuple = ()  # policy: the request's `tandem` options, as (key, value) pairs
    streamed: bool = True  # policy: asked streamed (False: the client gets the answer whole; `+stream=false`)

    @property
    def label(self) -> str:
        """Its row in the reports: the name, and the cut point where it has one."""
        return f"{self.name}@{self.cut}" if self.cut else self.name

    @property
    def asks(self) -> bool:
        """Whether its answers come from the gateway (a random router's come from the endpoints' rows)."""
        return self.kind != "random"


# -- the configuration as shipped -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shipped:
    """What `tandem serve` runs without --config: deploy/embedded.toml, with the settings' own defaults (policies/'
    constants) for what it leaves out."""

    path: Path
    where: str  # the path as a report names it
    toml: dict
    policy: str  # [gateway] policy: what a request that names none gets
    cloud: str  # [gateway] cloud: the cloud entry the policies use
    budget: float  # [disco] budget
    quality_threshold: float  # [disco] quality_threshold, else policies.quality.DEFAULT_THRESHOLD
    threshold_source: str
    device_model: str
    cloud_model: str

    @property
    def tokens(self) -> tuple[str, ...]:
        """The shipped rows, as --configs tokens: the endpoints alone, then the embedded default's policy and the
        quality policy at their shipped knobs (no per-request knob), each streamed and unstreamed."""
        policies = dict.fromkeys((self.policy, "quality"))
        return (*ENDPOINTS, *(f"policy:{p}{mode}" for p in policies for mode in ("", "+stream=false")))

    def describe(self, name: str) -> str:
        """A shipped row in words (its knobs as read); any other row: its name."""
        if name in ENDPOINTS:
            return f"{name} alone ({self.device_model if name == 'device' else self.cloud_model})"
        if name not in self.tokens:
            return name
        policy, _, mode = name.removeprefix("policy:").partition("+")
        knobs = [f"τ = {self.quality_threshold:g}"] if policy == "quality" else []
        if policy == self.policy:
            knobs.append(f"b = {self.budget:g}, the embedded default's policy")
        how = "unstreamed" + (", escalation starts over on the cloud" if policy == "quality" else "")
        return f"{policy} ({', '.join(knobs)}; as shipped), {how if mode else 'streamed'}"


def shipped(path: Path | None = None) -> Shipped:
    """The shipped configuration, read from deploy/embedded.toml (or `path`) through the settings' own models, so a
    knob the file leaves out is the code's default (e.g. τ: policies/quality.py's DEFAULT_THRESHOLD)."""
    path = Path(path or embedded_default())
    data = tomllib.loads(path.read_text())
    where = f"deploy/{path.name}" if path == embedded_default() else str(path)
    gateway = GatewaySettings(**{k: v for k, v in data.get("gateway", {}).items() if k != "state_file"})
    disco = DiscoSettings(**data.get("disco", {}))
    device = DeviceSettings(**data.get("device", {}))
    cloud = data.get("clouds", {}).get(gateway.cloud, {})
    if "quality_threshold" in data.get("disco", {}):
        source = f"{where} [disco] quality_threshold"
    else:
        source = "policies/quality.py DEFAULT_THRESHOLD"
    return Shipped(
        path=path,
        where=where,
        toml=data,
        policy=gateway.policy,
        cloud=gateway.cloud,
        budget=disco.budget,
        quality_threshold=disco.quality_threshold,
        threshold_source=f"{source}; DEFAULT_THRESHOLD = {DEFAULT_THRESHOLD:g}",
        device_model=device.model,
        cloud_model=cloud.get("model", ""),
    )


def gateway_config(ship: Shipped, device_model: str, cloud_model: str) -> str:
    """The shipped config with what the bench needs changed and nothing else: its admin key (the bench sets DiSCo's b
    for a `disco:B` row), the embedded cloud on a free port, only the gateway's own cloud (the HAT cloud, which no row
    asks, would share the cores), and the device's prompt cache off: the bench asks each prompt once per row, so
    with it every row after the first would restore the whole prompt (TTFT ~0.1 s, one token prefilled) and decode
    along another path than the first row's, where a user's new prompt is in no cache. Where a model other than the
    shipped one is asked (a test's small model): that model with a 4,096-token window."""
    data = copy.deepcopy(ship.toml)
    data.setdefault("gateway", {})["admin_keys"] = [ADMIN_KEY]
    data.setdefault("device", {}).update(NO_PROMPT_CACHE)
    cloud = data["clouds"][ship.cloud]
    data["clouds"] = {ship.cloud: cloud}
    embedded = cloud.get("embedded")
    if embedded is not None:
        embedded["port"] = 0
    device = data.setdefault("device", {})
    if device_model != ship.device_model:
        device.update(model=device_model, n_ctx=min(device.get("n_ctx", OVERRIDDEN_N_CTX), OVERRIDDEN_N_CTX))
    if cloud_model != ship.cloud_model:
        cloud["model"] = cloud_model
        cloud.pop("context_length", None)
        if embedded is not None:
            embedded.update(model=cloud_model, n_ctx=min(embedded.get("n_ctx", OVERRIDDEN_N_CTX), OVERRIDDEN_N_CTX))
    return to_toml(data)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def to_toml(data: dict) -> str:
    """A dict as read by tomllib, written back as TOML (every nested table as a [table]; tomllib reads it back
    equal). No TOML writer is a dependency, and the config holds only strings, numbers, booleans and lists."""
    lines: list[str] = []

    def table(values: dict, prefix: tuple[str, ...]) -> None:
        scalars = {k: v for k, v in values.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in values.items() if isinstance(v, dict)}
        if prefix and (scalars or not tables):
            lines.append(f"[{'.'.join(_key(p) for p in prefix)}]")
        lines.extend(f"{_key(k)} = {_value(v)}" for k, v in scalars.items())
        for key, value in tables.items():
            table(value, (*prefix, key))

    table(data, ())
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"no TOML for {value!r} in the shipped config")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's escapes are TOML basic-string escapes
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    raise ValueError(f"no TOML for {value!r} in the shipped config")


# -- standing -----------------------------------------------------------------------------------------------------


def standing(
    name: str,
    half: str,
    ship: Shipped,
    models_shipped: bool,
    matched_to: str | None = None,
    committed: Callable[[str], str | None] | None = None,
) -> str:
    """A row's standing in the report. On the report half only the shipped rows, with the shipped models, are
    results; the oracle router is a bound; a coin-flip router at a result's share is a reference; anything else
    asked there is exploration (in-sample). On the other halves nothing is held out. `committed` (--rescore): an
    asked row's standing as its committed file earns it (committed_standing), which wins."""
    if half != "report":
        return OTHER_HALVES[half]
    if name == ORACLE:
        return BOUND if models_shipped else EXPLORATION
    if matched_to is not None:
        was = standing(matched_to, half, ship, models_shipped, committed=committed)
        return REFERENCE if was in (RESULT, FORMER) else EXPLORATION
    if committed is not None and (was := committed(name)) is not None:
        return was
    return RESULT if models_shipped and name in ship.tokens else EXPLORATION


def committed_standing(name: str, row: dict | None, ship: Shipped, gateway: str) -> str | None:
    """A committed row's standing, never more than it can be: a result only if its file says so, it is a shipped
    row, and it was asked with the gateway config that is shipped now (else it was the default when committed);
    anything else the file says is exploration. None: no committed file."""
    if row is None:
        return None
    if row.get("standing") != RESULT or name not in ship.tokens:
        return EXPLORATION
    return RESULT if row.get("setup", {}).get("gateway") == gateway else FORMER


# -- --configs ----------------------------------------------------------------------------------------------------


def expand(text: str, ship: Shipped) -> str:
    """`shipped` in --configs stands for the shipped rows (Shipped.tokens)."""
    tokens = [t.strip() for t in text.split(",")]
    out: list[str] = []
    for token in tokens:
        for t in ship.tokens if token == "shipped" else (token,):
            if t and t not in out:
                out.append(t)
    return ",".join(out)


def parse_configs(text: str) -> list[Config]:
    configs = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        kind, _, value = token.partition(":")
        if token in ENDPOINTS:
            configs.append(Config(token, "endpoint", endpoint=token))
        elif kind == "disco" and value:
            budget = _unit(value, token)
            configs.append(Config(f"disco-b{budget:g}", "disco", budget=budget))
        elif kind == "random" and value == "matched":
            configs.append(Config("random-matched", "random"))
        elif kind == "random" and value:
            share = _unit(value, token)
            configs.append(Config(f"random-s{share:.2f}", "random", share=share))
        elif kind == "policy" and value:
            options = dict(_policy_options(value, token))
            streamed = options.pop("stream", True)
            if not isinstance(streamed, bool):
                raise SystemExit(f"error: --configs: {token!r}: stream=true or stream=false")
            configs.append(Config(token, "policy", options=tuple(options.items()), streamed=streamed))
        elif ">" in token and "@" in token:
            route, _, cut = token.partition("@")
            source, _, target = route.partition(">")
            if {source, target} != set(ENDPOINTS) or not cut.isdigit() or int(cut) < 1:
                raise SystemExit(f"error: --configs: {token!r}: write device>cloud@K or cloud>device@K, K >= 1")
            configs.append(forced(source, int(cut)))
        else:
            raise SystemExit(
                f"error: --configs: unknown configuration {token!r} (shipped, device, cloud, disco:B, random:S, "
                "random:matched, device>cloud@K, cloud>device@K, policy:NAME[+KEY=VALUE...])"
            )
    return configs


def forced(source: str, cut: int) -> Config:
    target = "cloud" if source == "device" else "device"
    return Config(f"{source}>{target}", "forced", endpoint=source, cut=cut)


def _policy_options(value: str, token: str) -> tuple:
    """`NAME+KEY=VALUE+...`: the request's `tandem` options, the policy and its knobs (a VALUE that reads as JSON is
    that JSON, e.g. a number; otherwise the text), e.g. policy:quality+quality_threshold=0.8 for a policy with a
    per-request knob; `stream=false` (the request's own field, not a `tandem` option) asks it unstreamed."""
    name, *pairs = value.split("+")
    options = {"policy": name}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not (key and sep and raw):
            raise SystemExit(f"error: --configs: {token!r}: write policy:NAME+KEY=VALUE")
        try:
            options[key] = json.loads(raw)
        except ValueError:
            options[key] = raw
    return tuple(options.items())


def threshold(text: str) -> float:
    try:
        return check_threshold(float(text))
    except ValueError as exc:
        raise SystemExit(f"error: --tune-thresholds: {text!r}: {exc}") from None


def _unit(text: str, token: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise SystemExit(f"error: --configs: {token!r}: the value must be a number in [0, 1]")
    return value
