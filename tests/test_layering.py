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
    "telemetry": {"domain", "rolloutd", "opentelemetry", "prometheus_client", "grpc", "v1"},
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


REFUSED: dict[str, set[str]] = {
    # the kind of a score's failure and an episode's end are typed fields of the domain
    "scoring": {"rolloutd.domain.episode_runner"},
    # drop reasons and failure kinds are the domain's; scoring loads worker pools
    "telemetry": {"rolloutd.scoring"},
}
"""Edges a row's wider rule would allow that must not come back: unit -> modules (and what is
under them) it may not import."""


def imported_modules(path: Path) -> set[str]:
    """The dotted names of the rolloutd modules ``path`` imports (``from a import b`` as ``a.b``
    too, since ``b`` may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {name for name in found if name.split(".")[0] == "rolloutd"}


def test_no_refused_edge_comes_back():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        refused = REFUSED.get(unit_of(path), set())
        bad = {
            m for m in imported_modules(path) for r in refused if m == r or m.startswith(r + ".")
        }
        if bad:
            offenders[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not offenders, offenders


def test_the_refusals_catch_an_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text(
        "from rolloutd.domain import episode_runner\nfrom rolloutd.scoring.stage import S\n"
    )
    assert {"rolloutd.domain.episode_runner", "rolloutd.scoring.stage"} <= imported_modules(f)


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
    # each owns its state and its part of a snapshot (docs/design.md, "The controller")
    "ids": set(),
    "accounting": set(),
    "ledger": set(),
    "intake": set(),
    "flight": {"ids"},
    "policy": {"accounting", "flight"},
    "drops": {"accounting", "flight"},
    "finisher": {"accounting", "drops", "flight"},
    "generation": {"accounting", "drops", "finisher", "flight", "ids"},
    "admission": {"accounting", "flight", "generation", "ids", "policy"},
    "leasing": {"accounting", "drops", "ledger", "policy"},
    "acking": {"accounting", "leasing", "ledger", "policy"},
    # the composition of the rooms, recovery (which asks each for its part) and the façade
    "rooms": {
        "accounting",
        "acking",
        "admission",
        "drops",
        "finisher",
        "flight",
        "generation",
        "ids",
        "intake",
        "leasing",
        "ledger",
        "policy",
    },
    # everything a snapshot keeps: one part a room
    "snapshot": {"accounting", "ledger", "policy"},
    "recovery": {"ledger", "rooms", "snapshot"},
    "controller": {"accounting", "acking", "ids", "ledger", "recovery", "rooms", "snapshot"},
}
"""The controller's rooms (domain modules) -> the rooms each may import. What is shared (the
buffer, the sampler, the barrier, the wake-ups, liveness) and every other domain module (groups, ports,
reports) is below the rooms: any room may import it, and it imports no room."""

SHARED = {"buffer", "sampler", "barrier", "wakeups", "liveness"}
"""What the rooms share, small and named for what it is."""


def test_the_controllers_rooms_import_only_what_their_row_lists():
    offenders = {}
    for path in sorted((PACKAGE / "domain").glob("*.py")):
        rooms = _modules_imported(path, "domain") & ROOMS.keys()
        allowed = ROOMS.get(path.stem, set())
        if rooms - allowed:
            offenders[path.stem] = sorted(rooms - allowed)
    assert not offenders, offenders
    assert all((PACKAGE / "domain" / f"{room}.py").exists() for room in ROOMS.keys() | SHARED)


def state_offences(source: str) -> list[str]:
    """Where a module's classes reach another object's state: an instance attribute set under
    a public name (state is ``self._x``, read through a property or a method), or a private
    member of anything but ``self`` or ``cls`` (a private method the module itself defines is
    the module's: the barrier's mutation calls its barrier's)."""
    found = []
    tree = ast.parse(source)
    friends = {
        n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if private and not mine and node.attr not in friends:
                found.append(f"line {node.lineno}: {ast.unparse(node)} (another's private member)")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            if not isinstance(target, ast.Attribute):
                continue
            mine = isinstance(target.value, ast.Name) and target.value.id == "self"
            if mine and not target.attr.startswith("_"):
                found.append(f"line {node.lineno}: {ast.unparse(target)} (public state)")
    return found


def room_assignments_to_others(source: str, rooms: set[str]) -> list[str]:
    """Attributes assigned on an object a room holds as another room or a shared part
    (``self._ledger.x = ...``): a room changes another only through its methods."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            held = target.value if isinstance(target, ast.Attribute | ast.Subscript) else None
            while isinstance(held, ast.Attribute | ast.Subscript):
                if isinstance(held, ast.Attribute) and held.attr.lstrip("_") in rooms:
                    found.append(f"line {node.lineno}: {ast.unparse(target)}")
                    break
                held = held.value
    return found


def test_each_room_keeps_its_state_to_itself():
    offenders = {}
    for room in sorted(ROOMS.keys() | SHARED):
        source = (PACKAGE / "domain" / f"{room}.py").read_text()
        found = state_offences(source) + room_assignments_to_others(source, ROOMS.keys() | SHARED)
        if found:
            offenders[room] = found
    assert not offenders, offenders


def test_the_room_rules_catch_reaching_in():
    source = (
        "class A:\n"
        "    def __init__(self, ledger):\n"
        "        self._ledger = ledger\n"
        "        self.count = 0\n"
        "    def go(self, buffer):\n"
        "        self._ledger.acks[1] = 2\n"
        "        self._ledger.steps += 1\n"
        "        return buffer._groups\n"
    )
    assert [o.split(":")[0] for o in state_offences(source)] == ["line 4", "line 8"]
    assert room_assignments_to_others(source, {"ledger"}) == [
        "line 6: self._ledger.acks[1]",
        "line 7: self._ledger.steps",
    ]


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
