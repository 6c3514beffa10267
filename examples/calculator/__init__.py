"""A calculator tool environment for rolloutd's episodes (``docs/environments.md``).

With ``examples/`` on the service's ``PYTHONPATH``, name it as
``episodes.environment: "calculator.environment:Calculator"``; ``rolloutd.yaml`` beside this file
is a whole configuration, and ``make example-agent`` runs it on the tiny model.
"""
