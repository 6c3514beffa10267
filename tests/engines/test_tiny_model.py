"""The tiny model builds locally in seconds and is an ordinary Hugging Face model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rolloutd.engines.tiny_model import (
    BOS,
    TinyModelSpec,
    build_tiny_model,
    ensure_tiny_model,
    write_random_weights,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_directory_is_a_llama_with_head_dim_64(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] == 64
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert config["vocab_size"] == len(tokenizer)


@pytest.mark.parametrize(
    "text", ["What is 37 + 48?", "  spaces\tand\nnewlines  ", "café, naïve, 数学, 🎉", ""]
)
def test_tokenizer_round_trips(model_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_compresses_the_arithmetic_it_was_trained_on(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "What is 123 + 45? The answer is 168."
    assert len(tokenizer(text).input_ids) < len(text.encode()) / 2


def test_chat_template_renders_messages(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        f"{BOS}<|system|>\nAnswer with a number.<|end|>\n"
        "<|user|>\nWhat is 2 + 2?<|end|>\n<|assistant|>\n"
    )
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.convert_tokens_to_ids("<|user|>") in ids


async def test_chat_template_lists_tools_first_as_the_synthetic_engine_does(
    model_dir: Path,
) -> None:
    from rolloutd.engines.synthetic import SyntheticEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is 17 * 23?"}]
    tools = [
        {"type": "function", "function": {"name": "calc", "description": "évalue: 2 * 3"}},
        {"type": "function", "function": {"name": "noop"}},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert rendered == (
        f"{BOS}<|system|>\n# Tools\n"
        + "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools)
        + "<|end|>\n<|user|>\nWhat is 17 * 23?<|end|>\n<|assistant|>\n"
    )
    synthetic = SyntheticEngine()
    assert rendered == await synthetic.render_chat(
        messages, tools=tools, add_generation_prompt=True
    )
    # without tools: exactly what the template rendered before tools existed
    assert (
        tokenizer.apply_chat_template(
            messages, tools=None, add_generation_prompt=True, tokenize=False
        )
        == f"{BOS}<|user|>\nWhat is 17 * 23?<|end|>\n<|assistant|>\n"
    )


def test_transformers_loads_and_runs_it(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([tokenizer("What is 3 + 4?").input_ids])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    top2 = logits[0, -1].topk(2).values
    assert float(top2[0] - top2[1]) > 1e-3, "greedy choice must not be a near tie"


def test_weights_are_normal_with_the_requested_std(model_dir: Path) -> None:
    weights = load_file(str(model_dir / "model.safetensors"))
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32, name
        if name.endswith("norm.weight"):
            assert torch.all(tensor == 1.0), name
        else:
            assert abs(float(tensor.std()) - 0.5) < 0.05, name


def test_build_is_reproducible(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_second_weights_differ_and_load_on_their_own(model_dir: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    second = write_random_weights(model_dir, tmp_path / "v1", seed=1, progress=lines.append)
    assert lines, "progress lines are reported"
    old = load_file(str(model_dir / "model.safetensors"))
    new = load_file(str(second / "model.safetensors"))
    assert old.keys() == new.keys()
    name = "model.embed_tokens.weight"
    assert old[name].shape == new[name].shape
    assert not torch.equal(old[name], new[name])
    assert (second / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32)


def test_ensure_builds_once_and_reuses(tmp_path: Path) -> None:
    lines: list[str] = []
    first = ensure_tiny_model(tmp_path / "cache", progress=lines.append)
    built = len(lines)
    assert built > 0
    second = ensure_tiny_model(tmp_path / "cache", progress=lines.append)
    assert second == first
    assert len(lines) == built, "the cached model is reused, not rebuilt"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name], "no temp dirs left"


def test_refuses_to_overwrite_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(FileExistsError):
        build_tiny_model(tmp_path / "taken")
    assert [p.name for p in tmp_path.iterdir()] == ["taken"], "the staging dir is removed"


def test_spec_rejects_head_dims_vllm_cpu_cannot_run() -> None:
    with pytest.raises(ValueError, match="must be 64"):
        TinyModelSpec(hidden_size=256, num_heads=16)
