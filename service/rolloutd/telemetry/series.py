"""The attribute sets of the catalogue's instruments, as the metric observers record them.

Every attribute set recorded is one the catalogue declares: a value it does not know raises
``KeyError`` (a wrong kind must fail, not vanish from a series).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from rolloutd.telemetry.catalogue import Instrument

Attributes = Mapping[str, str]


class CatalogueSeries:
    """The attribute sets of one instrument, built once from the catalogue.

    Looked up by attribute values in the catalogue's key order (enums or their string values);
    a combination the catalogue does not declare raises ``KeyError``.
    """

    def __init__(self, instrument: Instrument):
        self.instrument = instrument
        keys = tuple(instrument.attributes)
        self._sets: dict[tuple[str, ...], Attributes] = {
            tuple(s[k] for k in keys): MappingProxyType(s) for s in instrument.attribute_sets()
        }

    def __call__(self, *values: enum.Enum | str) -> Attributes:
        key = tuple(v.value if isinstance(v, enum.Enum) else v for v in values)
        try:
            return self._sets[key]
        except KeyError:
            given = dict(zip(self.instrument.attributes, key, strict=False))
            raise KeyError(
                f"{self.instrument.name}: attributes {given} are not in the catalogue"
            ) from None

    def all(self) -> Iterable[Attributes]:
        return self._sets.values()
