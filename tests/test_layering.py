"""Which part of rolloutd may import what (docs/design.md, "Layering"): one table, no exception list.

A unit is a subpackage (``domain``, ``checkpoint`` ...) or a top-level module (``server``,
``cli`` ...). Every import of every module is checked, including those inside functions: a unit
may import the standard library, itself, and exactly what its row lists, third-party included.
Any new edge fails here and must be added to the table on purpose; an edge nothing takes any
more must leave it.
"""

import ast
import graphlib
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "service" / "rolloutd"

ALLOWED: dict[str, set[str]] = {
    # the pure core: owns its ports (engine protocol, observer and report types, state)
    "domain": set(),
    # adapters around the domain
    "checkpoint": {"domain", "pyarrow", "fsspec", "numpy", "botocore", "zlib_ng"},
    "engines": {
        "domain",
        "torch",
        "transformers",
        "vllm",
        "tokenizers",
        "safetensors",
        "psutil",
        "numpy",
    },
    # scoring: its drop reasons and failure kinds are series labels
    "telemetry": {
        "domain",
        "rolloutd",
        "opentelemetry",
        "prometheus_client",
        "grpc",
        "v1",
        "scoring",
    },
    # verifiers behind the finishing stage port: worker processes, HTTP reward models
    "scoring": {"domain", "entrypoints", "httpx"},
    # environments behind the episode runner's port: user classes, environments served over HTTP
    "episodes": {"domain", "entrypoints", "httpx", "fastapi", "uvicorn", "pydantic"},
    # new weights: staged, checked against the served model, then loaded through the controller
    "weights": {"domain", "fsspec", "botocore", "aiohttp", "numpy", "zstandard", "torch"},
    "v1": {"google", "grpc"},
    "api": {
        "domain",
        "checkpoint",
        "v1",
        "rolloutd",
        "grpc",
        "grpc_health",
        "grpc_reflection",
        "google",
        "fastapi",
        "uvicorn",
        "pydantic",
        "prometheus_client",
        "telemetry",
        "weights",
        "push_codec",
    },
    # leaves used by the composition root
    "config": {"pydantic", "yaml", "domain", "checkpoint", "engines", "entrypoints", "scoring"},
    # user code named by "package.module:attribute" (stages, runners)
    "entrypoints": set(),
    "dataset": {"domain", "pyarrow"},
    # the wire encoding of a pushed chunk, written by the client and read by the service
    "push_codec": set(),
    "client": {"v1", "telemetry", "grpc", "push_codec"},
    "trainer": {"client", "v1", "grpc", "opentelemetry"},
    # the composition root and the command line
    "supervisor": set(),
    "server": {
        "scoring",
        "episodes",
        "startup",
        "supervisor",
        "api",
        "checkpoint",
        "config",
        "dataset",
        "domain",
        "engines",
        "entrypoints",
        "telemetry",
        "weights",
    },
    # `rolloutd rescore`: a store's rewards scored again
    "rescore": {"checkpoint", "config", "domain", "scoring"},
    # start-up failures a user causes, told in one line
    "startup": {"api", "checkpoint", "config", "dataset", "domain"},
    "cli": {
        "checkpoint",
        "config",
        "engines",
        "rescore",
        "server",
        "startup",
        "telemetry",
        "trainer",
        "rolloutd",
    },
    "rolloutd": set(),
}
"""unit -> what it may import besides the standard library and itself (``rolloutd``: the
package's own ``__init__``, e.g. ``__version__``)."""


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if rel.name == "__init__.py" and len(rel.parts) == 1:
        return "rolloutd"
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_units(path: Path) -> set[str]:
    """What ``path`` imports, as units of rolloutd or third-party top-level names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "rolloutd":
                found.add(parts[1] if len(parts) > 1 else "rolloutd")
            elif parts[0] not in sys.stdlib_module_names and parts[0] != "__future__":
                found.add(parts[0])
    return found


def test_every_import_is_an_allowed_edge():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = unit_of(path)
        assert unit in ALLOWED, f"{path.relative_to(PACKAGE)}: unit {unit!r} is not in the table"
        bad = imported_units(path) - ALLOWED[unit] - {unit}
        if bad:
            offenders[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not offenders, offenders


def test_the_domain_imports_the_standard_library_only():
    assert ALLOWED["domain"] == set()


def test_the_rule_catches_a_new_edge(tmp_path):
    f = tmp_path / "x.py"
    f.write_text(
        "import grpc\nfrom opentelemetry import trace\nfrom rolloutd.api import convert\n"
        "def late():\n    from rolloutd.checkpoint import store\n"
    )
    assert imported_units(f) == {"grpc", "opentelemetry", "api", "checkpoint"}


def test_the_table_allows_no_edge_that_nothing_takes():
    used: dict[str, set[str]] = {unit: set() for unit in ALLOWED}
    for path in PACKAGE.rglob("*.py"):
        unit = unit_of(path)
        used[unit] |= imported_units(path) - {unit}
    unused = {unit: sorted(ALLOWED[unit] - used[unit]) for unit in ALLOWED}
    assert not {unit: edges for unit, edges in unused.items() if edges}, unused


ROOMS: dict[str, set[str]] = {
    "core": set(),
    "generation": {"core"},
    "delivery": {"core"},
    "recovery": {"core", "generation", "delivery"},
    "controller": {"core", "generation", "delivery", "recovery"},
}
"""The controller's rooms (domain modules, docs/design.md "The controller") -> the rooms each
may import. Every other domain module (groups, the buffer, ports, reports) is below the rooms:
any room may import it, and it imports no room."""


def _domain_imports(path: Path) -> set[str]:
    """The ``rolloutd.domain`` modules ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[:2] == ["rolloutd", "domain"] and len(parts) > 2:
                found.add(parts[2])
    return found


def test_the_controllers_rooms_import_only_what_their_row_lists():
    offenders = {}
    for path in sorted((PACKAGE / "domain").glob("*.py")):
        rooms = _domain_imports(path) & ROOMS.keys()
        allowed = ROOMS.get(path.stem, set())
        if rooms - allowed:
            offenders[path.stem] = sorted(rooms - allowed)
    assert not offenders, offenders
    assert all((PACKAGE / "domain" / f"{room}.py").exists() for room in ROOMS)


EPISODES: dict[str, set[str]] = {
    "__init__": set(),
    "results": set(),
    "http": {"results"},
    "loader": {"results", "http"},
    "server": {"loader"},
}
"""The modules of ``episodes`` -> those of ``episodes`` each may import. The client the service
calls (``http``) never imports the server (``server``, FastAPI and uvicorn), which serves an
environment through the loader's in-process adapter."""


def _modules_imported(path: Path, package: str) -> set[str]:
    """The modules of ``rolloutd.<package>`` that ``path`` imports, however it names them
    (``from rolloutd.<package>.m import x``, ``from rolloutd.<package> import m``, ``import
    rolloutd.<package>.m``), inside functions included."""
    modules = {p.stem for p in (PACKAGE / package).glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module.split(".")
            names = [base, *([*base, a.name] for a in node.names if base == ["rolloutd", package])]
        else:
            continue
        found |= {n[2] for n in names if n[:2] == ["rolloutd", package] and len(n) > 2}
    return found & modules


def _import_graph(package: str) -> dict[str, set[str]]:
    """Each module of ``rolloutd.<package>`` -> the modules of the package it imports."""
    return {
        path.stem: _modules_imported(path, package) - {path.stem}
        for path in sorted((PACKAGE / package).glob("*.py"))
    }


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """A circle of imports in ``graph`` (its first module repeated at its end), or ``[]``."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return []


def test_the_episodes_modules_import_exactly_what_their_row_lists():
    """A new module needs a row, a new edge is added on purpose, and one nothing takes leaves."""
    assert _import_graph("episodes") == EPISODES


def test_the_episodes_client_does_not_import_the_server():
    assert "server" not in EPISODES["http"]
    assert "server" not in _import_graph("episodes")["http"]


def test_no_episodes_modules_import_each_other_in_a_circle():
    assert _circle(_import_graph("episodes")) == []
    assert _circle(EPISODES) == []


def test_the_rule_catches_a_circle_and_every_way_of_naming_a_module(tmp_path):
    assert _circle({"http": {"loader"}, "loader": {"http"}}) in (
        ["http", "loader", "http"],
        ["loader", "http", "loader"],
    )
    f = tmp_path / "x.py"
    f.write_text(
        "from rolloutd.episodes.http import HttpEnvironment\nimport rolloutd.episodes.results\n"
        "def late():\n    from rolloutd.episodes import loader, LocalEnvironment\n"
    )
    assert _modules_imported(f, "episodes") == {"http", "results", "loader"}
