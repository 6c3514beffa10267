"""Loading the configuration: one YAML file, overridden by ``ROLLOUTD_*`` environment variables,
then by flags (dotted keys), validated once into a :class:`~rolloutd.config.model.Config`. A
value that is missing, unknown or out of range is a :class:`ConfigError` naming its key.

Environment variables nest with a double underscore: ``ROLLOUTD_LIMITS__MAX_IN_FLIGHT=32`` sets
``limits.max_in_flight``; values are parsed as YAML scalars.

Kubernetes injects service-link variables for every Service in the namespace, and a Service named
``rolloutd-admin`` yields ``ROLLOUTD_ADMIN_SERVICE_HOST`` and friends. Exactly kubelet's naming
pattern is skipped (logged at debug); every other unknown ``ROLLOUTD_*`` name is still refused, so
a mistyped key never passes silently.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rolloutd.config.model import Config

ENV_PREFIX = "ROLLOUTD_"

log = logging.getLogger(__name__)

SERVICE_LINK = re.compile(
    r"^(?:[A-Z0-9_]*_)?(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?"
    r"|PORT(?:_[0-9]+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?)$"
)
"""The names kubelet gives a Service's links: ``{NAME}_SERVICE_HOST``, ``{NAME}_SERVICE_PORT``,
``{NAME}_SERVICE_PORT_{PORT_NAME}``, ``{NAME}_PORT`` and ``{NAME}_PORT_{N}_{PROTO}[_PROTO|_PORT|
_ADDR]``. None of them can be a configuration key: keys below a section need ``__``, and no
top-level key ends like this."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{dotted}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``ROLLOUTD_A__B=v`` becomes ``{"a": {"b": yaml(v)}}``."""
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name.startswith(ENV_PREFIX + "_"):
            continue
        dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
        if dotted in _NON_CONFIG_ENV:
            continue
        if "__" not in name and SERVICE_LINK.match(name):
            log.debug("ignoring %s: a Kubernetes service link, not a configuration key", name)
            continue
        _set_dotted(tree, dotted, yaml.safe_load(raw) if raw != "" else None)
    return tree


_NON_CONFIG_ENV = {"fault", "fault.point"}
"""ROLLOUTD_* variables that are not configuration keys (fault injection in tests)."""


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """File, then environment, then ``overrides`` (dotted keys from flags), validated once."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"config file {p}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p}: not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {p}: must be a mapping of keys, not {type(loaded).__name__}"
            )
        tree = loaded
    tree = _merge(tree, env_overrides(os.environ if environ is None else environ))
    for dotted, value in (overrides or {}).items():
        _set_dotted(tree, dotted, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"config key '{key}': {msg}")
    return "; ".join(lines)
