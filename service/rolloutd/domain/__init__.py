"""The core: groups, the mutation barrier, the buffer, the sampler, the controller, and its ports.

It imports the standard library only (tests/test_layering.py). It owns its ports: the engine
protocol and errors (``engine.py``), the observer and report types (``observer.py``,
``report.py``), and ``state.py``, the one value of all persistent state. What happens is reported
as plain data through :class:`rolloutd.domain.observer.Observer`.
"""
