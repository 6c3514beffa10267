"""The tiny model: a randomly initialised Llama with a byte-level BPE tokenizer, built locally.

No machine this service is developed or tested on can download weights, so the embedded default
model is made here in seconds: a tokenizer trained on an embedded corpus and a Llama whose weights
are drawn from N(0, std). With std 0.5 the logits are well separated, so greedy decoding is stable
across implementations (vLLM and Hugging Face transformers agree token for token in float32).

The head dimension is fixed at 64 because vLLM's CPU attention rejects smaller heads. A model
directory is a plain Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer
files), so anything that loads Hugging Face models loads it.

Directories appear atomically: each is written into a temporary sibling, fsynced, and renamed into
place, so a reader never sees a half-written model and concurrent builders do not clash.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaConfig

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]
"""Receives one human-readable line per build step."""

_BUILDER_VERSION = 2
"""Bumped whenever the builder's output changes for the same spec, to invalidate caches."""

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, "<|system|>", "<|user|>", "<|assistant|>", END_OF_TURN)
"""Special tokens, in id order (0..6); role tokens make chat prompts short and unambiguous."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n# Tools\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Renders ``messages`` prompts; the BOS comes from the template, so chat prompts are encoded
without adding special tokens again. With ``tools`` a system turn lists them first, one JSON
object a line (``engines/synthetic.py`` renders the same); without, the rendering is what it
was before tools existed."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and initialisation of the tiny model; every field is part of the cache key."""

    vocab_size: int = 2048
    """Target tokenizer vocabulary (the model's vocabulary is the tokenizer's actual size)."""
    hidden_size: int = 256
    """Width of the residual stream."""
    intermediate_size: int = 512
    """Width of the MLP."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads; ``hidden_size / num_heads`` must be 64 (vLLM's CPU attention)."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    max_position_embeddings: int = 2048
    """Longest sequence the model accepts."""
    std: float = 0.5
    """Standard deviation of every weight except the norms (which are 1)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads != 64:
            raise ValueError(
                f"hidden_size / num_heads must be 64 (vLLM's CPU attention rejects other head "
                f"sizes), got {self.hidden_size} / {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.vocab_size <= len(SPECIAL_TOKENS) + 256:
            raise ValueError(
                f"vocab_size must exceed the 256 byte tokens and {len(SPECIAL_TOKENS)} special "
                f"tokens, got {self.vocab_size}"
            )
        if self.std <= 0:
            raise ValueError(f"std must be positive, got {self.std}")


def _log_progress(line: str) -> None:
    logger.info("%s", line)


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    *,
    spec: TinyModelSpec | None = None,
    progress: Progress | None = None,
) -> Path:
    """Build the tiny model into ``out_dir`` (which must not exist or be empty); return its path.

    The result is a pure function of ``(seed, spec)``: the corpus is embedded and every random
    draw is seeded.
    """
    spec = spec or TinyModelSpec()
    say = progress or _log_progress
    out = Path(out_dir)
    with _staging(out) as tmp:
        say(f"[tiny-model] training a byte-level BPE tokenizer (target vocab {spec.vocab_size})")
        vocab = _write_tokenizer(tmp, spec)
        say(f"[tiny-model] tokenizer ready: {vocab} tokens")
        config = _llama_config(spec, vocab)
        config.save_pretrained(tmp)
        _write_generation_config(tmp, vocab_ids=_special_ids())
        say(
            f"[tiny-model] drawing weights N(0, {spec.std}) with seed {seed}: "
            f"{spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_heads} heads of 64"
        )
        params = _write_weights(tmp, config, seed=seed, std=spec.std)
        say(f"[tiny-model] {params / 1e6:.2f}M parameters written")
    say(f"[tiny-model] done: {out}")
    return out


def write_random_weights(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    seed: int,
    *,
    std: float = 0.5,
    progress: Progress | None = None,
) -> Path:
    """Write a second, independent set of weights for the model in ``model_dir``; return its path.

    ``out_dir`` becomes a complete Hugging Face directory (config and tokenizer copied from
    ``model_dir``), so it can be loaded on its own and also passed to ``UpdateWeights``, which reads
    only its safetensors files. Use a seed other than the model's to get different weights.
    """
    from transformers import LlamaConfig

    say = progress or _log_progress
    src = Path(model_dir)
    out = Path(out_dir)
    config = LlamaConfig.from_pretrained(src)
    with _staging(out) as tmp:
        for item in sorted(src.iterdir()):
            if item.is_file() and not item.name.endswith(".safetensors"):
                shutil.copy2(item, tmp / item.name)
        say(f"[tiny-model] drawing weights N(0, {std}) with seed {seed} for {src}")
        _write_weights(tmp, config, seed=seed, std=std)
    say(f"[tiny-model] weights written: {out}")
    return out


def ensure_tiny_model(
    cache_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    spec: TinyModelSpec | None = None,
    progress: Progress | None = None,
) -> Path:
    """Return the tiny model under ``cache_dir``, building it the first time.

    The directory name carries a hash of everything the build depends on (spec, seed, corpus,
    builder version), so a changed builder never reuses a stale model. When several processes
    race, each builds privately and the first rename wins; the others reuse the winner's.
    """
    spec = spec or TinyModelSpec()
    target = Path(cache_dir) / f"tiny-llama-{_cache_key(spec, seed)}"
    if target.is_dir():
        logger.debug("tiny model cached at %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        return build_tiny_model(target, seed, spec=spec, progress=progress)
    except FileExistsError:
        if target.is_dir():
            return target
        raise


def corpus() -> list[str]:
    """The embedded tokenizer-training corpus: English prose plus arithmetic questions and answers
    (the bundled prompt set is arithmetic), generated from a fixed seed."""
    rng = random.Random(20240611)
    lines = list(_PROSE)
    ops = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        sym, fn = rng.choice(ops)
        lines.append(f"What is {a} {sym} {b}? The answer is {fn(a, b)}.")
        lines.append(f"Compute {a}{sym}{b} and give only the number: {fn(a, b)}")
    return lines


_PROSE = (
    "A rollout service generates many completions for each prompt so that a trainer can compare "
    "them and learn which ones were better.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Please think step by step, show your reasoning, and then write the final answer.",
    "Question: If Alice has three apples and buys five more, how many apples does she have?",
    "Answer: She has eight apples in total, because three plus five equals eight.",
    "Reinforcement learning from verifiable rewards checks each answer against a reference.",
    "You are a helpful assistant. Answer the user's question as accurately as you can.",
    "The weather today is cloudy with a chance of rain in the afternoon and clear skies at night.",
    "Numbers: zero one two three four five six seven eight nine ten eleven twelve hundred thousand.",
    "Checkpoints are written periodically so that a restart loses nothing that was finished.",
)


def _special_ids() -> dict[str, int]:
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


def _write_tokenizer(out: Path, spec: TinyModelSpec) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    ids = _special_ids()
    got = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if got != ids:
        raise RuntimeError(f"special tokens must take ids {ids}, the trainer gave {got}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, ids[BOS])]
    )
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return tok.get_vocab_size()


def _llama_config(spec: TinyModelSpec, vocab: int) -> LlamaConfig:
    from transformers import LlamaConfig

    ids = _special_ids()
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.std,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
        dtype="float32",
        architectures=["LlamaForCausalLM"],
    )


def _write_generation_config(out: Path, vocab_ids: dict[str, int]) -> None:
    """Generation stops at EOS or at the end of an assistant turn, in vLLM and transformers."""
    cfg = {
        "bos_token_id": vocab_ids[BOS],
        "eos_token_id": [vocab_ids[EOS], vocab_ids[END_OF_TURN]],
        "pad_token_id": vocab_ids[PAD],
    }
    (out / "generation_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _write_weights(out: Path, config: LlamaConfig, *, seed: int, std: float) -> int:
    """Draw every weight from N(0, std) (norms stay 1) in parameter order; return the count.

    Drawing in place with our own generator keeps the result independent of how a transformers
    version happens to initialise modules.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    tensors: dict[str, torch.Tensor] = {}
    total = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)
            tensors[name] = param.detach().to(torch.float32).contiguous()
            total += param.numel()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return total


def _cache_key(spec: TinyModelSpec, seed: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"spec": asdict(spec), "seed": seed, "v": _BUILDER_VERSION}).encode())
    for line in corpus():
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()[:12]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` onto ``out``; ``out`` may exist only as an empty directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not an empty directory")
    try:
        os.replace(tmp, out)
    except OSError as exc:
        if out.is_dir() and any(out.iterdir()):
            raise FileExistsError(f"{out} was created concurrently") from exc
        raise
    _fsync(out.parent)


@contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """Yield a private directory next to ``out``; on success publish it as ``out``, else remove it."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        yield tmp
        for path in tmp.iterdir():
            path.chmod(0o644)
            _fsync(path)
        tmp.chmod(0o755)
        _fsync(tmp)
        _publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
