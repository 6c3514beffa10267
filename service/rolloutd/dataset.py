"""Prompt files: JSONL or Parquet, one prompt a row.

A row has ``prompt`` (text) or ``messages`` (chat, rendered by the engine's tokenizer), an optional
``id`` (else its position among the prompts, counted from 0), optional ``metadata`` (any JSON,
returned with the group), optional ``tools`` (a list of JSON objects: the tool schemas an
episode's chat template is rendered with, at most ``max_tools_bytes`` as JSON) and optional
``generation``: the row's own settings (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``max_tokens``, ``stop``, ``seed``, ``group_size``), over its source's and the service's.

Messages about a row count as an editor does, from 1: ``line N`` of a JSONL file (blank lines
count), ``row N`` of a Parquet file.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

from rolloutd.domain.encoder import tools_problem
from rolloutd.domain.group import Prompt
from rolloutd.domain.sampler import Source
from rolloutd.domain.spec import EMPTY, GenerationSpec, SpecError, SpecLimits, check

BUNDLED = "bundled:arithmetic"


class DatasetError(ValueError):
    """The prompt file cannot be used; the message names the file and row."""


NO_LIMITS = SpecLimits()
MAX_TOOLS_BYTES = 8 << 20
"""The default bound on a row's ``tools`` as JSON (the service passes
``limits.max_metadata_bytes``)."""


def _prompt(
    row: Any, index: int, where: str, limits: SpecLimits, max_tools_bytes: int = MAX_TOOLS_BYTES
) -> Prompt:
    """``index``: the prompt's position (its default id); ``where``: file and 1-based line or row."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where} is not an object")
    try:
        spec = GenerationSpec.from_json(row.get("generation"))
        check(spec, limits)
    except SpecError as exc:
        raise DatasetError(f"{where}: {exc}") from exc
    text = row.get("prompt")
    messages = row.get("messages")
    if text is None and messages is None:
        raise DatasetError(f"{where} has neither 'prompt' nor 'messages'")
    if text is not None and (not isinstance(text, str) or not text.strip()):
        raise DatasetError(f"{where}: 'prompt' must be non-empty text")
    chat: tuple[dict[str, str], ...] = ()
    if messages is not None:
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise DatasetError(f"{where}: 'messages' must be a list of {{role, content}}")
        chat = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    tools = row.get("tools")
    if tools is not None:
        problem = tools_problem(tools, max_tools_bytes)
        if problem is not None:
            raise DatasetError(f"{where}: 'tools' {problem}")
    metadata = row.get("metadata")  # any JSON value, delivered as it is (metadata_json)
    prompt_id = str(row["id"]) if row.get("id") is not None else str(index)
    fallback = "\n".join(m["content"] for m in chat)
    return Prompt(
        prompt_id=prompt_id,
        text=text if text is not None else fallback,
        metadata=metadata,
        messages=chat,
        generation=spec,
        tools=tuple(tools or ()),
    )


def load_prompts(
    path: str | None, limits: SpecLimits = NO_LIMITS, max_tools_bytes: int = MAX_TOOLS_BYTES
) -> tuple[list[Prompt], str]:
    """Returns the prompts and a content digest (part of the snapshot fingerprint). A row's
    generation settings must be within ``limits``, its tools within ``max_tools_bytes``."""
    if path is None or path == BUNDLED:
        data = resources.files("rolloutd").joinpath("data/arithmetic.jsonl").read_bytes()
        prompts = _from_jsonl(data, BUNDLED, limits, max_tools_bytes)
        return prompts, hashlib.sha256(data).hexdigest()[:16]
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise DatasetError(f"dataset {p}: {exc.strerror}") from exc
    if p.suffix == ".parquet":
        import io

        import pyarrow.parquet as pq

        rows = pq.read_table(io.BytesIO(data)).to_pylist()
        prompts = [
            _prompt(r, i, f"{p}: row {i + 1}", limits, max_tools_bytes) for i, r in enumerate(rows)
        ]
    else:
        prompts = _from_jsonl(data, str(p), limits, max_tools_bytes)
    if not prompts:
        raise DatasetError(f"dataset {p}: no prompts")
    ids = [pr.prompt_id for pr in prompts]
    if len(set(ids)) != len(ids):
        raise DatasetError(f"dataset {p}: prompt ids are not unique")
    return prompts, hashlib.sha256(data).hexdigest()[:16]


def load_source(
    name: str,
    path: str | None,
    weight: float = 1.0,
    generation: GenerationSpec = EMPTY,
    limits: SpecLimits = NO_LIMITS,
    max_tools_bytes: int = MAX_TOOLS_BYTES,
) -> tuple[Source, str]:
    """One weighted source and its digest: of its name, content and generation settings."""
    prompts, digest = load_prompts(path, limits, max_tools_bytes)
    settings = json.dumps([name, digest, generation.to_json()], sort_keys=True)
    return Source(name, prompts, weight, generation), hashlib.sha256(settings.encode()).hexdigest()[
        :16
    ]


def _from_jsonl(
    data: bytes, where: str, limits: SpecLimits, max_tools_bytes: int = MAX_TOOLS_BYTES
) -> list[Prompt]:
    prompts: list[Prompt] = []
    for lineno, line in enumerate(data.decode().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: line {lineno + 1} is not JSON: {exc.msg}") from exc
        where_ = f"{where}: line {lineno + 1}"
        prompts.append(_prompt(row, len(prompts), where_, limits, max_tools_bytes))
    return prompts
