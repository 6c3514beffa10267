"""KV-cache sizing on CPU (no engine needed)."""

from __future__ import annotations

from rolloutd.engines.vllm_kv_cache import (
    CPU_KV_CACHE_CAP_GIB,
    GIB,
    kv_bytes_per_token,
    plan_cpu_kv_cache,
)

TINY = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "dtype": "float32",
}


def test_bytes_per_token_counts_keys_and_values_of_every_layer():
    assert kv_bytes_per_token(TINY, "float32") == 2 * 2 * 4 * 64 * 4
    assert kv_bytes_per_token(TINY, "auto") == 2 * 2 * 4 * 64 * 4  # the model's own dtype
    assert kv_bytes_per_token(TINY, "bfloat16") == 2 * 2 * 4 * 64 * 2


def test_grouped_query_heads_and_nested_text_config():
    gqa = {
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "torch_dtype": "bfloat16",
    }
    assert kv_bytes_per_token(gqa, "auto") == 2 * 4 * 2 * 64 * 2
    assert kv_bytes_per_token({"text_config": gqa}, "auto") == kv_bytes_per_token(gqa, "auto")


def test_tiny_model_default_plan_is_well_under_a_gib():
    plan = plan_cpu_kv_cache(TINY, "float32", sequences=16 * 4, max_model_len=2048)
    assert plan.bytes == 64 * 2048 * 4096
    assert plan.bytes < GIB
    assert not plan.capped
    assert "engine.vllm.kv_cache_memory_gib" in plan.describe()


def test_large_plans_are_capped_but_keep_one_full_sequence():
    big = {**TINY, "num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128}
    plan = plan_cpu_kv_cache(big, "float32", sequences=256, max_model_len=4096)
    assert plan.capped and plan.bytes == int(CPU_KV_CACHE_CAP_GIB * GIB)
    huge_len = plan_cpu_kv_cache(big, "float32", sequences=1, max_model_len=65536)
    assert huge_len.bytes == 65536 * kv_bytes_per_token(big, "float32")  # the floor wins
