"""New weights from anywhere: a local directory, an fsspec URL, or streamed by the trainer.

Staged (:mod:`~rolloutd.weights.staging`), verified against the served model
(:mod:`~rolloutd.weights.layout`), then loaded (:mod:`~rolloutd.weights.updater`, one update at a
time on its own threads: :mod:`~rolloutd.weights.pool`); what happened is reported as plain data
(:mod:`~rolloutd.domain.weights`). Modules are imported where used, so the engines' import of the
report does not pull in fsspec.
"""
