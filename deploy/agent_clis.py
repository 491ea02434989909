"""Install the coding-agent CLIs that `tandem bench agents` and tests/integration/test_agent_clis.py drive, at pinned
versions, into a cache outside the repository (like the models and llama-server).

- Claude Code, Codex CLI and opencode from the npm registry (`npm install --prefix <cache>/node`), with the
  `@ai-sdk/openai-compatible` provider opencode loads for an OpenAI-compatible base URL, so that nothing is
  fetched when they run;
- aider from PyPI into a virtualenv of its own under the cache: its many pinned dependencies (litellm and the rest)
  must not enter the project's .venv.

The cache is `$TANDEM_AGENTS_DIR`, else `$XDG_CACHE_HOME/tandem/agents` (default ~/.cache/tandem/agents). The npm
packages need `node` on PATH; as root, with apt-get and no `node`, the install takes Debian's `nodejs` and `npm`
(as the set-up does for the dashboard test's browser). Only the set-up uses the registries: a run that finds a CLI
missing says which command installs it.

Usage: python -m deploy.agent_clis install   (a no-op when every pinned CLI is there)
       python -m deploy.agent_clis check     (exit 1, saying what is missing)
       python -m deploy.agent_clis path [NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

INSTALL_COMMAND = "python -m deploy.agent_clis install"  # `make agents` runs it with the project's Python


@dataclass(frozen=True)
class AgentCli:
    name: str  # what the bench and the tests call it
    package: str  # on its registry
    version: str  # pinned, exact
    registry: str  # "npm" | "pypi"
    executable: str  # its command


# Versions current on the registries when pinned (`npm view PKG version`, `pip index versions aider-chat`).
AGENTS: dict[str, AgentCli] = {
    a.name: a
    for a in (
        AgentCli("claude", "@anthropic-ai/claude-code", "2.1.332", "npm", "claude"),
        AgentCli("codex", "@openai/codex", "0.171.0", "npm", "codex"),
        AgentCli("opencode", "opencode-ai", "1.18.33", "npm", "opencode"),
        AgentCli("aider", "aider-chat", "0.86.2", "pypi", "aider"),
    )
}
# Not a CLI: the provider package opencode loads for `"npm": "@ai-sdk/openai-compatible"`, installed beside it.
NPM_EXTRAS = {"@ai-sdk/openai-compatible": "3.0.97"}
# What opencode installs into each config folder it reads when the folder has no node_modules holding it (its
# plugin API, at its own version): installed once here, and each scratch HOME's config folder seeded from it.
OPENCODE_PLUGIN = "@opencode-ai/plugin"


class InstallError(RuntimeError):
    pass


def _progress(msg: str) -> None:
    print(f"[agent-clis] {msg}", file=sys.stderr, flush=True)


def agents_dir() -> Path:
    root = os.environ.get("TANDEM_AGENTS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem", "agents"
    )
    return Path(root)


def node_prefix() -> Path:
    return agents_dir() / "node"


def node_modules() -> Path:
    return node_prefix() / "node_modules"


def opencode_seed() -> Path:
    """An npm prefix holding opencode's plugin package: what its config folder gets (seed_home)."""
    return agents_dir() / "opencode-config"


def aider_venv() -> Path:
    return agents_dir() / f"aider-{AGENTS['aider'].version}"


def executable(name: str) -> Path:
    """Where the named CLI's command is (or would be installed)."""
    agent = AGENTS[name]
    if agent.registry == "npm":
        return node_modules() / ".bin" / agent.executable
    return aider_venv() / "bin" / agent.executable


def _npm_pins() -> dict[str, str]:
    return {**{a.package: a.version for a in AGENTS.values() if a.registry == "npm"}, **NPM_EXTRAS}


def _npm_version(package: str) -> str | None:
    try:
        return json.loads((node_modules() / package / "package.json").read_text()).get("version")
    except (OSError, ValueError):
        return None


def _seed_version() -> str | None:
    try:
        return json.loads((opencode_seed() / "node_modules" / OPENCODE_PLUGIN / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def seed_home(home: Path) -> None:
    """What the CLIs would otherwise fetch when they start, laid into a scratch HOME from the cache: opencode's
    config folder's plugin package (package.json, the lockfile that lists it, node_modules linked), so that it finds
    it installed and runs no install, and its provider package where it looks for one it does not bundle; aider's
    model price list."""
    config = home / ".config" / "opencode"
    config.mkdir(parents=True, exist_ok=True)
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(opencode_seed() / name, config / name)
    if not (config / "node_modules").exists():
        (config / "node_modules").symlink_to(opencode_seed() / "node_modules", target_is_directory=True)
    for package in NPM_EXTRAS:
        inside = home / ".cache" / "opencode" / "packages" / package / "node_modules" / package
        inside.parent.mkdir(parents=True, exist_ok=True)
        if not inside.exists():
            inside.symlink_to(node_modules() / package, target_is_directory=True)
    # aider fetches LiteLLM's model price list from GitHub unless its cache holds a copy less than a day old: the
    # copy LiteLLM ships, fresh.
    prices = next(aider_venv().glob("lib/python*/site-packages/litellm/model_prices_and_context_window_backup.json"))
    caches = home / ".aider" / "caches"
    caches.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(prices, caches / "model_prices_and_context_window.json")


def _aider_stamp() -> Path:
    return aider_venv() / "tandem-installed"


def problems() -> list[str]:
    """What is missing or not at its pinned version (empty when every CLI is ready)."""
    found = []
    if shutil.which("node") is None:
        found.append("node is not on PATH (the npm CLIs run on it)")
    for package, version in _npm_pins().items():
        have = _npm_version(package)
        if have != version:
            found.append(f"{package} {version}: " + (f"{have} installed" if have else f"not in {node_modules()}"))
    for name, agent in AGENTS.items():
        if agent.registry == "npm" and _npm_version(agent.package) == agent.version and not executable(name).exists():
            found.append(f"{agent.package}: no `{agent.executable}` command in {executable(name).parent}")
    if _seed_version() != AGENTS["opencode"].version:
        found.append(f"{OPENCODE_PLUGIN} {AGENTS['opencode'].version}: not in {opencode_seed()}")
    aider = AGENTS["aider"]
    if not (_aider_stamp().is_file() and _aider_stamp().read_text().strip() == aider.version):
        found.append(f"{aider.package} {aider.version}: not installed in {aider_venv()}")
    return found


def missing_message() -> str:
    """Why the CLIs cannot run, and the one command that installs them ("" when they can)."""
    found = problems()
    if not found:
        return ""
    return f"the agent CLIs are not installed: {'; '.join(found)}. Install them: `{INSTALL_COMMAND}` (`make agents`)"


# Each CLI's telemetry, error reports, update checks and other traffic beyond the model's requests, off.
QUIET = {
    "DISABLE_TELEMETRY": "1",  # Claude Code
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",  # opencode
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # aider's LiteLLM: its bundled price map, not a download
    "DO_NOT_TRACK": "1",
    "NO_COLOR": "1",
}


def run_env(home: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a CLI runs in: `base` (default: this process's) with `home` as HOME and every config, data,
    cache and state folder the CLIs use under it (nothing of the user's read or written), telemetry off (QUIET), and
    node's folder on PATH."""
    env = dict(os.environ if base is None else base)
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL", "OPENAI_API_KEY", "OPENAI_BASE_URL",
                 "OPENAI_API_BASE", "CLAUDE_CONFIG_DIR", "CODEX_HOME"):  # fmt: skip
        env.pop(name, None)  # the user's keys and endpoints never reach a CLI the bench points at its gateway
    folders = {
        "HOME": home,
        "XDG_CONFIG_HOME": home / ".config",
        "XDG_DATA_HOME": home / ".local" / "share",
        "XDG_CACHE_HOME": home / ".cache",
        "XDG_STATE_HOME": home / ".local" / "state",
        "CLAUDE_CONFIG_DIR": home / ".claude",
        "CODEX_HOME": home / ".codex",
        "TMPDIR": home / "tmp",
    }
    for name, folder in folders.items():
        folder.mkdir(parents=True, exist_ok=True)
        env[name] = str(folder)
    env.update(QUIET)
    node = shutil.which("node", path=env.get("PATH"))
    if node is None and (found := shutil.which("node")):
        env["PATH"] = os.pathsep.join([str(Path(found).parent), env.get("PATH", os.defpath)])
    return env


def _ensure_node() -> None:
    if shutil.which("node") and shutil.which("npm"):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        _progress("no node on PATH: installing Debian's nodejs and npm (apt-get)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "nodejs", "npm"], check=True, env=env)
        if shutil.which("node") and shutil.which("npm"):
            return
    raise InstallError(
        "node and npm are needed for Claude Code, Codex CLI and opencode: install Node.js 18 or later "
        "(Debian: sudo apt-get install nodejs npm), then run this again"
    )


def _npm_install(prefix: Path, specs: list[str]) -> None:
    prefix.mkdir(parents=True, exist_ok=True)
    _progress(f"npm install {' '.join(specs)} (into {prefix})")
    subprocess.run(
        ["npm", "install", "--prefix", str(prefix), "--save-exact", "--no-audit", "--no-fund", "--no-update-notifier",
         "--loglevel", "error", *specs],
        check=True, stdout=sys.stderr,
    )  # fmt: skip


def _install_npm() -> None:
    pins = _npm_pins()
    plugin = AGENTS["opencode"].version
    if all(_npm_version(p) == v for p, v in pins.items()) and _seed_version() == plugin:
        _progress(f"npm packages cached in {node_modules()} and {opencode_seed()}")
        return
    _ensure_node()
    _npm_install(node_prefix(), [f"{p}@{v}" for p, v in pins.items()])
    _npm_install(opencode_seed(), [f"{OPENCODE_PLUGIN}@{plugin}"])
    wrong = {p: _npm_version(p) for p, v in pins.items() if _npm_version(p) != v}
    if wrong or _seed_version() != plugin:
        raise InstallError(f"npm installed other versions than pinned: {wrong or {OPENCODE_PLUGIN: _seed_version()}}")


def _install_aider() -> None:
    agent, venv = AGENTS["aider"], aider_venv()
    if _aider_stamp().is_file() and _aider_stamp().read_text().strip() == agent.version:
        _progress(f"aider cached in {venv}")
        return
    shutil.rmtree(venv, ignore_errors=True)
    _progress(f"creating {venv} and installing {agent.package}=={agent.version} (pip; a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-compile", "--disable-pip-version-check", "--progress-bar", "off",
         f"{agent.package}=={agent.version}"],
        check=True, stdout=sys.stderr,
    )  # fmt: skip
    _aider_stamp().write_text(agent.version + "\n")


def _versions() -> dict[str, str]:
    """Each CLI's own `--version` line: each one starts and runs here."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="tandem-agent-home-") as home:  # they write their folders there
        env = run_env(Path(home))
        seed_home(Path(home))
        for name in AGENTS:
            result = subprocess.run(
                [str(executable(name)), "--version"], capture_output=True, text=True, timeout=120,
                env=env, cwd=home,
            )  # fmt: skip
            if result.returncode != 0:
                raise InstallError(f"`{executable(name)} --version` failed: {(result.stderr or result.stdout)[-500:]}")
            out[name] = (result.stdout.strip() or result.stderr.strip()).splitlines()[-1]
    return out


def install() -> None:
    _install_npm()
    _install_aider()
    for name, line in _versions().items():
        _progress(f"{name}: {line}")
    left = problems()
    if left:
        raise InstallError("; ".join(left))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.agent_clis")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="install the pinned CLIs into the cache unless they are there")
    sub.add_parser("check", help="exit 1 unless every pinned CLI is installed")
    p = sub.add_parser("path", help="print where each CLI's command is (all, or those named)")
    p.add_argument("names", nargs="*", metavar="NAME", help=", ".join(AGENTS))
    args = parser.parse_args(argv)
    unknown = [n for n in getattr(args, "names", ()) if n not in AGENTS]
    if unknown:
        parser.error(f"unknown CLI {unknown[0]!r} (one of {', '.join(AGENTS)})")
    try:
        if args.cmd == "install":
            install()
        elif args.cmd == "check":
            message = missing_message()
            if message:
                print(f"error: {message}", file=sys.stderr)
                return 1
            for name, agent in AGENTS.items():
                print(f"{name:9s} {agent.package}=={agent.version}  {executable(name)}")
        else:
            for name in args.names or AGENTS:
                print(executable(name))
    except (InstallError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
