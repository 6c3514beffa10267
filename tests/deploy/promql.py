"""Reading PromQL the way the dashboard and the alerts use it: names, labels, label values."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import promql_parser

from rolloutd.telemetry.catalogue import Instrument

from .prometheus_names import by_series_name, label_name, label_names

GRAFANA_BUILTINS = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
}
"""Grafana's interval variables, replaced by a duration so the expression parses."""

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute(expr: str, variables: set[str]) -> str:
    """Replace Grafana variables; an undefined one is an error (a panel that can never load)."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        if name not in variables:
            raise ValueError(f"undefined dashboard variable ${name} in {expr!r}")
        return "value"

    return _VARIABLE.sub(replace, expr)


@dataclass
class Selector:
    name: str
    instrument: Instrument | None
    matchers: list[tuple[str, str, str]]
    """(label, operator, value) of each matcher, the operator as PromQL writes it."""


@dataclass
class Query:
    expr: str
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)
    """Labels named in by(...), without(...), on(...), ignoring(...) and group_left/right(...)."""

    def problems(self) -> list[str]:
        """What in this query does not exist in the catalogue, in words."""
        out = []
        available = set()
        for s in self.selectors:
            if s.instrument is None:
                out.append(f"{s.name} is not a series of any catalogue instrument")
                continue
            labels = label_names(s.instrument) | ({"le"} if s.name.endswith("_bucket") else set())
            available |= labels
            for label, op, value in s.matchers:
                if label not in labels:
                    out.append(f"{s.name} has no label {label!r}")
                elif op == "=" and not _known_value(s.instrument, label, value):
                    out.append(f"{s.name}{{{label}={value!r}}}: not a value the catalogue lists")
        for label in sorted(self.grouping - available):
            out.append(f"groups by {label!r}, which no series of the query carries")
        return out


def _known_value(instrument: Instrument, label: str, value: str) -> bool:
    for key, values in instrument.attributes.items():
        if label_name(key) == label:
            return value in values
    return True  # open attributes and target labels take any value


def parse(expr: str, variables: set[str] = frozenset()) -> Query:
    """Parse with a real PromQL parser and collect what the expression refers to."""
    query = Query(expr)
    series = by_series_name()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = [
                (m.name, _OPERATORS[str(m.op)], m.value)
                for m in node.matchers.matchers
                if m.name != "__name__"
            ]
            query.selectors.append(Selector(node.name, series.get(node.name), matchers))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            query.grouping |= set(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            modifier = node.modifier
            if modifier.matching is not None:
                query.grouping |= set(modifier.matching.labels)
            if modifier.group_labels is not None:  # set operators (and, or) have none
                query.grouping |= set(modifier.group_labels)

    promql_parser.walk(promql_parser.parse(substitute(expr, set(variables))), visit)
    if not query.selectors:
        raise ValueError(f"{expr!r} reads no series")
    return query


_OPERATORS = {
    "MatchOp.Equal": "=",
    "MatchOp.NotEqual": "!=",
    "MatchOp.Re": "=~",
    "MatchOp.NotRe": "!~",
}
