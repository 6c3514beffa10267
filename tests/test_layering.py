"""The domain, checkpoint and weights packages import no adapter library (DESIGN.md §1): weight
updates report plain data that telemetry/ and api/ turn into spans, metrics and responses."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "service" / "rolloutd"
FORBIDDEN = {
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "opentelemetry",
    "fastapi",
    "uvicorn",
    "vllm",
    "google",
    "torch",
    "transformers",
}
PURE = ("domain", "checkpoint", "weights")


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
            if node.module.startswith("rolloutd.") and node.module.split(".")[1] in (
                "api",
                "telemetry",
                "v1",
            ):
                roots.add(node.module)
    return roots


def test_pure_packages_import_no_adapters():
    offenders = {}
    for pkg in PURE:
        for path in (PACKAGE / pkg).rglob("*.py"):
            bad = {r for r in imported_roots(path) if r in FORBIDDEN or r.startswith("rolloutd.")}
            if bad:
                offenders[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not offenders, offenders


def test_the_rule_catches_an_adapter_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import grpc\nfrom opentelemetry import trace\nfrom rolloutd.api import convert\n")
    assert {"grpc", "opentelemetry", "rolloutd.api"} <= imported_roots(f)
