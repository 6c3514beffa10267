"""Request checks shared by the gRPC servicer and the admin HTTP app: one place per field.

Each raises :class:`InvalidArgument` naming the field; gRPC answers ``INVALID_ARGUMENT`` and HTTP
422, with the same message. Checks of fields only one API has live next to its decoding
(``convert.prompt_from_proto``) or in the domain (``Controller.fetch``).
"""

from __future__ import annotations

from rolloutd.checkpoint.tags import tag_problem
from rolloutd.domain.errors import InvalidArgument


def checkpoint_request(tag: str, trainer_step: int | None) -> None:
    """``Checkpoint`` / ``POST /v1/checkpoints``: the tag and the trainer step."""
    if trainer_step is not None and trainer_step < 0:
        raise InvalidArgument("trainer_step", f"must be >= 0, got {trainer_step}")
    problem = tag_problem(tag)
    if problem is not None:
        raise InvalidArgument("tag", problem)
