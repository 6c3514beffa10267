"""OpenTelemetry adapters: SDK setup, the metric catalogue, and the observer that feeds them.

- :mod:`~rolloutd.telemetry.providers`: ``setup_telemetry()`` -> :class:`Telemetry` (providers
  from the settings, the Prometheus registry, bounded shutdown);
- :mod:`~rolloutd.telemetry.settings`: the ``OTEL_*`` environment, resolved once;
- :mod:`~rolloutd.telemetry.tracer_provider`: the SDK's tracer provider, which knows whether
  spans have a processor;
- :mod:`~rolloutd.telemetry.otel_adapter`: the one module that uses private members of the
  OpenTelemetry packages, each listed there with its test;
- :mod:`~rolloutd.telemetry.observer`: :class:`TelemetryObserver`, the domain's observer;
- :mod:`~rolloutd.telemetry.sources`: the snapshots behind the observable instruments;
- :mod:`~rolloutd.telemetry.interceptors`: gRPC server and client tracing;
- :mod:`~rolloutd.telemetry.catalogue`, :mod:`~rolloutd.telemetry.metrics`,
  :mod:`~rolloutd.telemetry.spans`, :mod:`~rolloutd.telemetry.prometheus`,
  :mod:`~rolloutd.telemetry.throttle`.

Nothing is re-exported here, so the client library can import the interceptors without loading
the SDK's exporters.
"""
