"""The memory planner and the KV geometry it is built on.

Expected values are computed by hand here from vLLM's page rules (bytes per token = full-attention
layers x KV heads x 2 (K and V) x head_dim x dtype bytes; on a hybrid the attention block grows
until a page holds one sequence's state, layers share block ids in groups, and a full-window
request takes its attention blocks plus one block per state group), and checked against the
owner's KV pool ledger (docs/incidents.md#kv-pool-ledger): the measured pools reproduce the
concurrency vLLM printed, and config.json predicts every Nemotron and Qwen3.8 pool of it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from samples import SERVED_PAIR

from sparkform.domain import modelconfig
from sparkform.domain.modelconfig import GIB
from sparkform.rules import planner
from sparkform.rules.inventory import load_inventory

REPO = Path(__file__).resolve().parents[2]
MODEL_CONFIGS = REPO / "tests" / "fixtures" / "model_configs"


def eng(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in data["engines"] if e["name"] == name)


def config(name: str) -> dict[str, Any]:
    return json.loads((MODEL_CONFIGS / name).read_text())


def by_name(result: planner.Plan) -> dict[str, planner.EnginePlan]:
    return {e.name: e for e in result.engines}


def within(value: float, expected: float, rel: float = 0.02) -> bool:
    return abs(value - expected) <= rel * abs(expected)


# --- KV geometry from config.json -------------------------------------------------------------------


def test_dense_gqa_geometry_falls_back_to_hidden_size_over_heads():
    geo = modelconfig.geometry(config("dense_gqa_llama.json"))
    assert (geo.num_layers, geo.kv_layers, geo.state_layers) == (32, 32, 0)
    assert (geo.kv_heads, geo.head_dim) == (8, 4096 // 32)
    assert not geo.is_hybrid
    assert geo.native_max_len == 131072
    # bf16 ("auto" follows torch_dtype): 32 layers x 8 heads x 2 x 128 x 2 bytes = 131,072 bytes.
    per_token = 32 * 8 * 2 * 128 * 2
    assert modelconfig.kv_dtype_bytes("auto", config("dense_gqa_llama.json")) == 2
    assert geo.bytes_per_token(2) == per_token == 131072
    assert geo.tokens_per_gib(2) == 2**30 / per_token == 8192
    # fp8 halves the page: twice the tokens.
    assert geo.tokens_per_gib(modelconfig.kv_dtype_bytes("fp8", {})) == 16384


def test_qwen35_like_layer_types_count_only_full_attention_layers():
    cfg = config("qwen3_5_hybrid.json")
    geo = modelconfig.geometry(cfg)  # the numbers live under text_config
    assert geo.architecture == "Qwen3_5ForConditionalGeneration"
    assert (geo.num_layers, geo.kv_layers, geo.state_layers) == (64, 16, 48)
    assert (geo.kv_heads, geo.head_dim) == (4, 256)
    assert geo.is_hybrid
    assert geo.native_max_len == 262144
    # fp8: 16 x 4 x 2 x 256 x 1 = 32,768 bytes per token -> 2^30 / 2^15 = 32,768 tokens per GiB
    # of per-token KV alone, 4 % above the ~31K per GiB measured for Qwen3.8 on the owner's Spark
    # (the state blocks take the rest: test_config_json_predicts_every_served_pair_pool).
    assert geo.bytes_per_token(1) == 16 * 4 * 2 * 256 == 32768
    assert geo.tokens_per_gib(modelconfig.kv_dtype_bytes("fp8", cfg)) == 32768
    assert within(geo.tokens_per_gib(1), 953_661 / 30.33, rel=0.05)  # the owner's 31,443 per GiB
    # auto: the model's bf16, half as many.
    assert geo.tokens_per_gib(modelconfig.kv_dtype_bytes("auto", cfg)) == 16384


def test_nemotron_h_like_pattern_counts_only_star_layers():
    cfg = config("nemotron_h.json")
    geo = modelconfig.geometry(cfg)
    pattern = cfg["hybrid_override_pattern"]
    assert (geo.num_layers, geo.kv_layers, geo.state_layers) == (52, 6, pattern.count("M"))
    assert geo.state_layers == 23
    assert (geo.kv_heads, geo.head_dim) == (2, 128)
    assert geo.native_max_len == 1_048_576  # the owner's pair: "native 1,048,576"
    # fp8: 6 x 2 x 2 x 128 = 3,072 bytes per token -> 349,525 tokens per GiB of per-token KV
    # alone, above the owner's measured ~305-327K (the Mamba state blocks take the rest).
    assert geo.bytes_per_token(1) == 6 * 2 * 2 * 128 == 3072
    assert int(geo.tokens_per_gib(1)) == 349_525
    measured_low, measured_high = 2_777_998 / 9.12, 2_703_604 / 8.26
    assert measured_low < measured_high < geo.tokens_per_gib(1) < 1.2 * measured_low


@pytest.mark.parametrize(
    ("fixture", "kib_per_token", "kv_layers"),
    [
        (
            "qwen3_next_80b.json",
            12,
            12,
        ),  # kv-pool-ledger, 2026-06-07: "Qwen3-Next-80B 12 KB (12 of 48 layers full attention)"
        ("qwen3_6_35b.json", 10, 10),  # "Qwen3.6-35B 10 KB (10 of 40)"
        ("qwen3_32b_dense.json", 128, 64),  # "Qwen3-32B dense 128 KB"
    ],
)
def test_seed_per_token_kv_with_fp8(fixture, kib_per_token, kv_layers):
    geo = modelconfig.geometry(config(fixture))
    assert geo.kv_layers == kv_layers
    assert geo.bytes_per_token(modelconfig.kv_dtype_bytes("fp8", {})) == kib_per_token * 1024


def test_the_hybrid_gets_ten_times_the_tokens_per_gib_of_dense_attention():
    # docs/incidents.md#even-split: ~305K against ~31K, "the ratio is ten times either way".
    for window in (131_072, 262_144):
        hybrid = modelconfig.geometry(config("nemotron_h_mamba.json")).layout(1, window).tokens_per_gib
        dense = modelconfig.geometry(config("qwen3_5_hybrid.json")).layout(1, window).tokens_per_gib
        assert 9.5 < hybrid / dense < 11.5


def test_hybrid_paging_by_vllms_rules():
    """Nemotron-H: one sequence's Mamba-2 state per layer is conv (kernel-1) x (heads x head_dim +
    2 x groups x state) in bf16 plus SSM heads x head_dim x state in float32 (config.json's
    mamba_ssm_cache_dtype, vLLM's default for Nemotron-H). The attention block grows in steps of 16
    until its page holds that; 6 attention and 23 Mamba layers share block ids in groups of 6 (1
    attention group, 4 Mamba groups); a full-window request takes ceil(window / block) + 4."""
    cfg = config("nemotron_h_mamba.json")
    state = (4 - 1) * (64 * 64 + 2 * 8 * 128) * 2 + 64 * 64 * 128 * 4
    token_bytes = 2 * 2 * 128 * 1  # KV heads x (K+V) x head_dim x fp8
    block = 16 * -(-state // (16 * token_bytes))
    assert (state, block) == (2_134_016, 4176)
    layout = modelconfig.geometry(cfg).layout(1, 131_072)
    assert (layout.block_tokens, layout.block_bytes, layout.state_groups) == (block, block * token_bytes * 6, 4)
    assert layout.blocks_per_request == -(-131_072 // block) + 4 == 36
    assert modelconfig.geometry(cfg).layout(1, 262_144).blocks_per_request == 63 + 4
    # Without the field vLLM takes float32 for Nemotron-H; a bf16 SSM state halves the block.
    del cfg["mamba_ssm_cache_dtype"]
    assert modelconfig.geometry(cfg).layout(1, 131_072).block_tokens == 4176
    cfg["mamba_ssm_cache_dtype"] = "bfloat16"
    assert modelconfig.geometry(cfg).layout(1, 131_072).block_tokens == 16 * -(-1_085_440 // (16 * 512)) == 2128
    # Qwen3.5 / Qwen3.8 (Gated DeltaNet): conv 3 x (2 x 16 x 128 + 48 x 128) in bf16, recurrent
    # 48 x 128 x 128 in float32 (mamba_ssm_dtype); 16 attention, 48 linear layers: groups of 16.
    qwen = modelconfig.geometry(config("qwen3_5_hybrid.json")).layout(1, 131_072)
    state = 3 * (2 * 16 * 128 + 48 * 128) * 2 + 48 * 128 * 128 * 4
    assert qwen.block_tokens == 16 * -(-state // (16 * 2048)) == 1568
    assert (qwen.block_bytes, qwen.blocks_per_request) == (1568 * 2048 * 16, 84 + 3)
    # Attention-only models: vLLM's 16-token blocks, all layers in one group.
    dense = modelconfig.geometry(config("dense_gqa_llama.json")).layout(2, 131_072)
    assert (dense.block_tokens, dense.block_bytes, dense.blocks_per_request, dense.state_groups) == (
        16,
        16 * 4096 * 32,
        131_072 // 16,
        0,
    )
    assert dense.tokens_per_gib == 8192
    # A hybrid whose config.json lacks the state's dimensions cannot be paged.
    assert modelconfig.geometry(config("nemotron_h.json")).layout(1, 131_072) is None


@pytest.mark.parametrize(
    ("fixture", "text"),
    [("no_attention_heads.json", "'num_attention_heads'"), ("no_full_attention.json", "no full-attention layer")],
)
def test_geometry_refuses_configs_without_kv_layers(fixture, text):
    with pytest.raises(modelconfig.ModelConfigError, match=text):
        modelconfig.geometry(config(fixture))


def test_geometry_needs_layer_count_for_dense_models():
    cfg = config("dense_gqa_llama.json")
    del cfg["num_hidden_layers"]
    with pytest.raises(modelconfig.ModelConfigError, match="num_hidden_layers"):
        modelconfig.geometry(cfg)


def test_load_reports_missing_and_invalid_files(tmp_path):
    with pytest.raises(modelconfig.ModelConfigError, match="does not exist"):
        modelconfig.load(tmp_path / "config.json")
    with pytest.raises(modelconfig.ModelConfigError, match="not valid JSON"):
        modelconfig.load(MODEL_CONFIGS / "not_json.json")


def test_kv_dtype_bytes():
    assert modelconfig.kv_dtype_bytes("fp8_e4m3", {}) == 1
    assert modelconfig.kv_dtype_bytes("nvfp4", {}) == 0.5
    assert modelconfig.kv_dtype_bytes("bfloat16", {"torch_dtype": "float32"}) == 2
    assert modelconfig.kv_dtype_bytes("auto", {"torch_dtype": "float32"}) == 4
    assert modelconfig.kv_dtype_bytes("auto", {"text_config": {"dtype": "float16"}}) == 2
    assert modelconfig.kv_dtype_bytes("auto", {}) == 2  # bfloat16 when the config says nothing


# --- the owner's KV pool ledger (docs/incidents.md#kv-pool-ledger) -------------------------------------


def seed_at_131k(seed_data: dict[str, Any], measured: dict[str, tuple[float, int]]) -> dict[str, Any]:
    for name, (kv_gib, tokens) in measured.items():
        e = eng(seed_data, name)
        e["max_model_len"] = 131_072
        e["measured"] = {"kv_cache_gib": kv_gib, "kv_pool_tokens": tokens}
    return seed_data


def test_seed_systemd_rows_reproduce_pools_and_concurrency(seed_data, make_host):
    # 2026-08-19, systemd, after retirements: 9.12 GiB / 2,777,998 tokens / 21.2x and
    # 30.33 GiB / 953,661 tokens / 7.28x, both at 131,072.
    data = seed_at_131k(seed_data, {"nemotron": (9.12, 2_777_998), "q38": (30.33, 953_661)})
    plans = by_name(planner.plan(make_host(data)))
    nemotron, q38 = plans["nemotron"], plans["q38"]
    assert nemotron.pool_tokens == 2_777_998
    assert q38.pool_tokens == 953_661
    assert within(nemotron.concurrency, 21.2)
    assert within(q38.concurrency, 7.28)
    assert f"{nemotron.concurrency:.1f}" == "21.2"
    assert f"{q38.concurrency:.2f}" == "7.28"
    assert (nemotron.kv_source, nemotron.tokens_source) == ("measured", "measured")
    # share = utilization x 121 GiB; non-KV = share - KV.
    assert nemotron.share_gib == pytest.approx(0.25 * 121)
    assert nemotron.non_kv_gib == pytest.approx(30.25 - 9.12)
    assert q38.non_kv_gib == pytest.approx(54.45 - 30.33)


def test_seed_rounded_tokens_per_gib_reproduce_concurrency(seed_data, make_host):
    # "Nemotron about 305K, Qwen3.8 about 31K" tokens per GiB.
    data = seed_at_131k(seed_data, {"nemotron": (9.12, round(9.12 * 305_000)), "q38": (30.33, round(30.33 * 31_000))})
    plans = by_name(planner.plan(make_host(data)))
    assert plans["nemotron"].tokens_per_gib == pytest.approx(305_000)
    assert plans["q38"].tokens_per_gib == pytest.approx(31_000)
    assert within(plans["nemotron"].pool_tokens, 2_777_998)
    assert within(plans["q38"].pool_tokens, 953_661)
    assert within(plans["nemotron"].concurrency, 21.2)
    assert within(plans["q38"].concurrency, 7.28)


LEDGER = [
    # The field notes' "KV pool ledger" (docs/incidents.md#kv-pool-ledger):
    # (date, engine row, KV GiB, pool tokens, window, concurrency vLLM printed)
    ("2026-06-07 Qwen3-Next-80B", 20.8, 1_722_225, 131_072, 13.1),
    ("2026-06-09 Qwen3-Next-80B", 24.75, 2_106_551, 262_144, 8.04),
    ("2026-06-12 Qwen3-Next-80B", 24.64, 2_097_152, 262_144, 8.00),
    ("2026-08-19 Nemotron even", 14.36, 4_372_707, 131_072, 33.4),
    ("2026-08-19 Qwen3.8 even", 7.05, 221_466, 131_072, 1.69),
    ("2026-08-19 Qwen3.8 rebalanced", 19.49, 613_175, 131_072, 4.68),
    ("2026-08-19 Nemotron rebalanced", 5.67, 1_725_781, 131_072, 13.2),
    ("2026-08-19 Nemotron systemd", 9.12, 2_777_998, 131_072, 21.2),
    ("2026-08-19 Qwen3.8 systemd", 30.33, 953_661, 131_072, 7.28),
    ("2026-08-20 Nemotron raised", 8.26, 2_703_604, 262_144, 10.31),
    ("2026-08-20 Qwen3.8 raised", 26.8, 858_483, 262_144, 3.27),
]


@pytest.mark.parametrize(
    ("kv_gib", "tokens", "window", "printed"), [row[1:] for row in LEDGER], ids=[row[0] for row in LEDGER]
)
def test_every_ledger_row_comes_back_exactly(seed_data, make_host, kv_gib, tokens, window, printed):
    e = eng(seed_data, "q38")
    e.update(max_model_len=window, measured={"kv_cache_gib": kv_gib, "kv_pool_tokens": tokens})
    q38 = by_name(planner.plan(make_host(seed_data)))["q38"]
    assert q38.pool_tokens == tokens  # exact: the pool vLLM printed, not one token short
    assert round(q38.concurrency, 2) == pytest.approx(printed, abs=0.051)


# The Nemotron and Qwen3.8 rows of LEDGER (the owner's field notes, "KV pool ledger": the boot
# log's `Available KV cache memory`, `KV cache size` and `Maximum concurrency` lines; also
# docs/incidents.md#kv-pool-ledger) with the engine, its config.json and the row's utilization.
# Both engines ran an fp8 KV cache (the notes' per-token figures are fp8's) and max_num_seqs 128
# (the pool does not move with it).
SERVED_PAIR_ROWS = {
    "2026-08-19 Nemotron even": ("nemotron", "nemotron_h_mamba.json", 0.30),
    "2026-08-19 Qwen3.8 even": ("q38", "qwen3_5_hybrid.json", 0.30),
    "2026-08-19 Qwen3.8 rebalanced": ("q38", "qwen3_5_hybrid.json", 0.38),
    "2026-08-19 Nemotron rebalanced": ("nemotron", "nemotron_h_mamba.json", 0.22),
    "2026-08-19 Nemotron systemd": ("nemotron", "nemotron_h_mamba.json", 0.25),
    "2026-08-19 Qwen3.8 systemd": ("q38", "qwen3_5_hybrid.json", 0.45),
    "2026-08-20 Nemotron raised": ("nemotron", "nemotron_h_mamba.json", 0.25),
    "2026-08-20 Qwen3.8 raised": ("q38", "qwen3_5_hybrid.json", 0.45),
}


def at_ledger_row(data: dict[str, Any], name: str, fixture: str, util: float, kv_gib: float, window: int) -> None:
    """The engine as the row booted it, with the KV memory it printed but not its tokens."""
    eng(data, name).update(
        gpu_memory_utilization=util,
        model_config_path=fixture,
        kv_cache_dtype="fp8",
        max_model_len=window,
        max_num_seqs=128,
        measured={"gpu_memory_utilization": util, "kv_cache_gib": kv_gib},
    )


@pytest.mark.parametrize("row", SERVED_PAIR_ROWS)
def test_config_json_predicts_every_served_pair_pool(seed_data, make_host, row):
    name, fixture, util = SERVED_PAIR_ROWS[row]
    kv_gib, tokens, window, printed = next(entry[1:] for entry in LEDGER if entry[0] == row)
    at_ledger_row(seed_data, name, fixture, util, kv_gib, window)
    plan = by_name(planner.plan(make_host(seed_data)))[name]
    assert (plan.kv_source, plan.tokens_source) == ("measured", "config.json")
    assert plan.kv_gib == pytest.approx(kv_gib)
    assert plan.pool_tokens == tokens  # to the token (the planner's target is 2 %)
    assert round(plan.concurrency, 2) == pytest.approx(printed, abs=0.051)


def test_the_147_mamba_cache_blocks_are_qwen38_at_the_even_split(seed_data, problems_of):
    # The notes' refusal, "max_num_seqs (256) exceeds available Mamba cache blocks (147)": by the
    # page rules that is Qwen3.8's pool at the even split; no Nemotron row holds fewer than 474.
    at_ledger_row(seed_data, "q38", "qwen3_5_hybrid.json", 0.30, 7.05, 131_072)
    eng(seed_data, "q38")["max_num_seqs"] = 256
    (problem,) = problems_of(seed_data)
    assert (problem.engine, problem.field, problem.value) == ("q38", "max_num_seqs", 256)
    assert "above the 147 Mamba cache blocks" in problem.message


def test_window_is_a_ceiling_not_a_reservation(seed_data, make_host):
    # The owner's 2026-08-20 prediction (docs/incidents.md#window-raise): the 131K pools at a
    # 262,144 window give 10.6x and 3.6x ("allocates nothing"). The restart measured 10.31x and
    # 3.27x: non-KV workspace grows with the window, which the planner cannot know before the boot
    # log says so.
    data = seed_at_131k(seed_data, {"nemotron": (9.12, 2_777_998), "q38": (30.33, 953_661)})
    for name in ("nemotron", "q38"):
        eng(data, name)["max_model_len"] = 262_144
    plans = by_name(planner.plan(make_host(data)))
    assert plans["nemotron"].pool_tokens == 2_777_998  # the pool does not shrink with the window
    assert f"{plans['nemotron'].concurrency:.1f}" == "10.6"
    assert f"{plans['q38'].concurrency:.1f}" == "3.6"


def test_seed_inventory_plan(monkeypatch):
    for var in ("SPARK_HOST", "SPARK_USER", "SPARK_HF_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    (spark,) = load_inventory(SERVED_PAIR)
    result = planner.plan(spark)
    plans = by_name(result)
    assert plans["nemotron"].pool_tokens == 2_703_604
    assert plans["q38"].pool_tokens == 858_483
    assert f"{plans['nemotron'].concurrency:.2f}" == "10.31"
    assert f"{plans['q38'].concurrency:.2f}" == "3.27"
    assert result.used_gib == pytest.approx(0.70 * 121)
    assert result.free_gib == pytest.approx(0.30 * 121)


# --- estimates from config.json and weights ------------------------------------------------------------


def test_estimate_from_weights_and_config(seed_data, make_host):
    # q38 from the owner's own numbers: 21.81 GiB weights, ~2.3 GiB other non-KV, util 0.45.
    e = eng(seed_data, "q38")
    e.update(
        weights_gib=21.81,
        non_kv_overhead_gib=2.31,
        kv_cache_dtype="fp8",
        model_config_path="qwen3_5_hybrid.json",
        max_model_len=131_072,
    )
    result = planner.plan(make_host(seed_data))
    q38 = by_name(result)["q38"]
    kv = 0.45 * 121 - 21.81 - 2.31  # 30.33 GiB: the owner's measured pool
    assert q38.kv_gib == pytest.approx(kv)
    assert q38.non_kv_gib == pytest.approx(21.81 + 2.31)
    assert q38.kv_source == "share - weights - overhead"
    assert q38.tokens_source == "config.json"
    # vLLM's paging (test_hybrid_paging_by_vllms_rules): blocks of 1,568 tokens, 16 layers x 1,568
    # x 2,048 bytes a block id, 84 + 3 blocks a full-window request.
    block_bytes = 16 * 1568 * 2048
    assert q38.tokens_per_gib == pytest.approx(2**30 * 131_072 / (87 * block_bytes))
    assert q38.pool_tokens == int(kv * 2**30 // block_bytes) * 131_072 // 87
    assert q38.pool_tokens == 953_661  # what the engine printed at 30.33 GiB, to the token
    assert q38.state_blocks == 633
    assert (
        "q38: KV from share - weights - overhead; tokens/GiB from config.json (blocks of 1,568 tokens, 87 per "
        "full-window request); 633 Mamba cache blocks for max_num_seqs 128"
    ) in planner.format_plan(result)


def test_dense_config_is_not_labelled_an_upper_bound(seed_data, make_host):
    eng(seed_data, "q38").update(
        model_config_path="dense_gqa_llama.json", weights_gib=16.0, max_model_len=131_072, kv_cache_dtype="auto"
    )
    q38 = by_name(planner.plan(make_host(seed_data)))["q38"]
    assert q38.tokens_source == "config.json"
    assert q38.tokens_per_gib == 8192  # bf16 KV
    assert q38.state_blocks is None
    kv = 0.45 * 121 - 16.0 - 2.5  # default non-KV overhead 2.5 GiB
    # Whole 16-token blocks of 32 layers x 16 x 4,096 bytes.
    assert q38.pool_tokens == int(kv * 2**30 // (32 * 16 * 4096)) * 16
    assert q38.concurrency == pytest.approx(q38.pool_tokens / 131_072)


def test_measured_tokens_per_gib_wins_over_config(seed_data, make_host):
    eng(seed_data, "q38").update(
        model_config_path="qwen3_5_hybrid.json", measured={"kv_cache_gib": 30.33, "kv_pool_tokens": 953_661}
    )
    q38 = by_name(planner.plan(make_host(seed_data)))["q38"]
    assert q38.tokens_source == "measured"
    assert q38.tokens_per_gib == pytest.approx(953_661 / 30.33)


def test_share_smaller_than_weights_leaves_no_pool(seed_data, make_host):
    eng(seed_data, "q38").update(
        gpu_memory_utilization=0.15, weights_gib=21.81, model_config_path="qwen3_5_hybrid.json"
    )
    q38 = by_name(planner.plan(make_host(seed_data)))["q38"]
    assert q38.kv_gib == 0.0
    assert q38.pool_tokens == 0
    assert q38.concurrency == 0.0


def test_kv_cache_memory_bytes_pins_the_pool(seed_data, make_host):
    eng(seed_data, "nemotron").update(
        kv_cache_memory_bytes=8 * GIB, model_config_path="nemotron_h.json", kv_cache_dtype="fp8", max_model_len=131_072
    )
    nemotron = by_name(planner.plan(make_host(seed_data)))["nemotron"]
    assert nemotron.kv_gib == 8.0
    assert nemotron.kv_source == "kv_cache_memory_bytes"
    assert nemotron.non_kv_gib is None
    assert nemotron.pool_tokens == round(8 * 2**30 / 3072)
    assert nemotron.concurrency == pytest.approx(round(8 * 2**30 / 3072) / 131_072)


def test_unknown_figures_leave_question_marks_and_no_split(seed_data, make_host):
    result = planner.plan(make_host(seed_data))  # no measured, no weights, no config.json
    for e in result.engines:
        assert e.kv_gib is None and e.tokens_per_gib is None
        assert e.pool_tokens is None and e.concurrency is None
        assert e.kv_source.startswith("unknown") and e.tokens_source.startswith("unknown")
    assert result.split is None
    text = planner.format_plan(result)
    assert "recommended split: none (needs each engine's non-KV size and tokens per GiB" in text
    nemotron_row = next(line for line in text.splitlines() if line.strip().startswith("nemotron "))
    assert nemotron_row.split()[-1] == "?"


def test_disabled_engines_are_not_planned(seed_data, make_host):
    seed_data["engines"].append(
        {
            "name": "embed",
            "port": 8004,
            "enabled": False,
            "gpu_memory_utilization": 0.1,
            "checkpoint": {"repo": "BAAI/bge-m3", "revision": "main"},
        }
    )
    result = planner.plan(make_host(seed_data))
    assert [e.name for e in result.engines] == ["nemotron", "q38"]
    assert result.used_gib == pytest.approx(0.70 * 121)


# --- the recommended split -----------------------------------------------------------------------------


def seed_pair_by_weights(seed_data: dict[str, Any], util: tuple[float, float]) -> dict[str, Any]:
    """The owner's pair at 131,072 with fixed non-KV costs taken from the systemd rows (nemotron
    30.25 - 9.12 = 21.13 GiB, q38 54.45 - 30.33 = 24.12 GiB) and tokens per GiB from config.json,
    so the pool follows the utilization."""
    for name, utilization, weights, overhead, model_config in [
        ("nemotron", util[0], 18.63, 2.5, "nemotron_h.json"),
        ("q38", util[1], 21.81, 2.31, "qwen3_5_hybrid.json"),
    ]:
        eng(seed_data, name).update(
            gpu_memory_utilization=utilization,
            weights_gib=weights,
            non_kv_overhead_gib=overhead,
            model_config_path=model_config,
            kv_cache_dtype="fp8",
            max_model_len=131_072,
        )
    return seed_data


def test_even_split_starves_dense_engine_and_recommendation_gives_it_more(seed_data, make_host):
    host = make_host(seed_pair_by_weights(seed_data, (0.35, 0.35)))
    result = planner.plan(host)
    plans = by_name(result)
    # The even split: nemotron (42.35 - 21.13) GiB x 349,525 / 131,072 ~ 56.6x; q38 (42.35 - 24.12)
    # GiB in 380 blocks of 49 MiB, 87 a full-window request ~ 4.4x. Thirteen to one.
    assert plans["nemotron"].concurrency == pytest.approx((42.35 - 21.13) * 2**30 / 3072 / 131_072, rel=1e-3)
    assert int((42.35 - 24.12) * 2**30 // (16 * 1568 * 2048)) == 380
    assert plans["q38"].concurrency == pytest.approx(380 / 87, rel=1e-5)
    assert plans["nemotron"].concurrency / plans["q38"].concurrency > 10

    split = result.split
    assert split is not None
    assert split.utilization["q38"] > 0.35 > split.utilization["nemotron"]
    # By hand: q38 takes 87 x 16 x 1,568 x 2,048 bytes = 4.163 GiB a full-window request, so
    # c = (84.7 - 45.25) / (131072/349525 + 4.163) = 8.69 full-window requests;
    # nemotron (21.13 + 0.375 c) / 121 = 0.202 -> 0.20, q38 (24.12 + 4.163 c) / 121 = 0.498 -> 0.50.
    assert split.utilization == {"nemotron": 0.20, "q38": 0.50}
    assert sum(split.utilization.values()) == pytest.approx(0.70)
    low, high = sorted(split.concurrency.values())
    assert high / low < 1.25  # roughly equal (0.01 steps of utilization are coarse for the hybrid)
    assert "equal concurrency" in result.split_note


def test_recommended_split_delivers_the_concurrency_it_promises(seed_data, make_host):
    first = planner.plan(make_host(seed_pair_by_weights(copy.deepcopy(seed_data), (0.35, 0.35))))
    again = planner.plan(
        make_host(
            seed_pair_by_weights(seed_data, (first.split.utilization["nemotron"], first.split.utilization["q38"]))
        )
    )
    for e in again.engines:
        assert e.concurrency == pytest.approx(first.split.concurrency[e.name], rel=0.01)
    # ... and a split that is already balanced recommends itself.
    assert again.split.utilization == first.split.utilization


def test_seed_inventory_split_favours_q38_and_keeps_the_total(monkeypatch):
    for var in ("SPARK_HOST", "SPARK_USER", "SPARK_HF_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    (spark,) = load_inventory(SERVED_PAIR)
    result = planner.plan(spark)
    split = result.split
    # Equalising from measured pools at 262,144: q38 takes more, nemotron gives some back.
    assert split.utilization["q38"] > 0.45 and split.utilization["nemotron"] < 0.25
    assert sum(split.utilization.values()) == pytest.approx(0.70)
    before = by_name(result)
    assert abs(split.concurrency["nemotron"] - split.concurrency["q38"]) < abs(
        before["nemotron"].concurrency - before["q38"].concurrency
    )
    assert "recommended split (equal concurrency at each engine's max_model_len): nemotron 0.21" in planner.format_plan(
        result
    )


def test_rounding_never_grows_the_total(seed_data, make_host):
    # Two identical engines sharing 0.67: each "wants" 0.335, which rounds up to 0.34 (0.68 total).
    for name in ("nemotron", "q38"):
        eng(seed_data, name).update(
            gpu_memory_utilization=0.335,
            weights_gib=20.0,
            model_config_path="qwen3_5_hybrid.json",
            kv_cache_dtype="fp8",
            max_model_len=131_072,
        )
    eng(seed_data, "q38").update(served_names=["q38"], multimodal=False)
    split = planner.plan(make_host(seed_data)).split
    assert sorted(split.utilization.values()) == [0.33, 0.34]
    assert sum(split.utilization.values()) <= 0.67 + 1e-9


def test_no_split_for_one_engine(seed_data, make_host):
    seed_data["engines"] = seed_data["engines"][:1]
    result = planner.plan(make_host(seed_data))
    assert result.split is None
    assert result.split_note == "one generating engine: nothing to split"


def test_an_embedding_engine_keeps_its_share_out_of_the_pair_s_split(seed_data, make_host):
    """The field notes' third unit (bge-m3 beside the pair): the pair's split is the same with it,
    and its own share stays as the inventory gives it."""
    seed_pair_by_weights(seed_data, (0.25, 0.45))
    pair = planner.plan(make_host(seed_data))
    seed_data["engines"].append(
        {
            "name": "embed",
            "port": 8004,
            "kind": "embed",
            "checkpoint": {"repo": "BAAI/bge-m3", "revision": "main"},
            "after": ["nemotron", "q38"],
            "gpu_memory_utilization": 0.05,
            "max_model_len": 8192,
            "weights_gib": 1.1,
        }
    )
    three = planner.plan(make_host(seed_data))
    assert pair.split is not None and three.split == pair.split
    embed = by_name(three)["embed"]
    assert embed.kind == "embed" and embed.share_gib == 0.05 * three.memory_total_gib
    assert three.used_gib == pair.used_gib + embed.share_gib
    assert "embed: KV from" in planner.format_plan(three) and "a pooling engine (embed)" in planner.format_plan(three)
    # Alone beside one generator, the split has nothing to share.
    seed_data["engines"] = [seed_data["engines"][0], {**seed_data["engines"][-1], "after": ["nemotron"]}]
    assert planner.plan(make_host(seed_data)).split is None


def test_no_split_when_the_shares_do_not_hold_the_weights(seed_data, make_host):
    seed_pair_by_weights(seed_data, (0.10, 0.15))
    eng(seed_data, "nemotron")["weights_gib"] = 30.0
    result = planner.plan(make_host(seed_data))
    assert result.split is None
    assert result.split_note == "the shares do not even hold the engines' weights"


def test_measured_pool_follows_a_changed_utilization(monkeypatch):
    for var in ("SPARK_HOST", "SPARK_USER", "SPARK_HF_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    (spark,) = load_inventory(SERVED_PAIR)
    data = spark.config.model_dump(exclude_none=True)
    data["engines"][1]["gpu_memory_utilization"] = 0.49  # what the plan recommends
    from sparkform.rules.inventory import load_host

    q38 = by_name(planner.plan(load_host("spark", data)))["q38"]
    # Measured 26.8 GiB at 0.45; at 0.49 the share is 4.84 GiB larger and so is the pool.
    assert q38.kv_gib == pytest.approx(26.8 + 0.04 * 121, rel=0.01)
    assert q38.kv_source == "measured at 0.45, re-derived"


# --- output ------------------------------------------------------------------------------------------


def test_format_plan_table(seed_data, make_host):
    data = seed_at_131k(seed_data, {"nemotron": (9.12, 2_777_998), "q38": (30.33, 953_661)})
    text = planner.format_plan(planner.plan(make_host(data, name="spark.local")))
    lines = text.splitlines()
    assert lines[0] == "host spark.local: 121.0 GiB unified memory"
    assert lines[1].split() == [
        "engine",
        "util",
        "share",
        "GiB",
        "weights",
        "GiB",
        "non-KV",
        "GiB",
        "KV",
        "GiB",
        "tok/GiB",
        "KV",
        "pool",
        "tok",
        "window",
        "concurrency",
    ]
    nemotron = lines[2].split()
    assert nemotron == ["nemotron", "0.25", "30.25", "?", "21.13", "9.12", "304,605", "2,777,998", "131,072", "21.19x"]
    q38 = lines[3].split()
    assert q38[0] == "q38" and q38[-3:] == ["953,661", "131,072", "7.28x"]
    assert "engines take 84.70 GiB; 36.30 GiB stays free (headroom asked: 20.0 GiB)" in text
    assert "nemotron: KV from measured; tokens/GiB from measured" in text


def test_plan_as_dict_is_json(seed_data, make_host):
    data = seed_at_131k(seed_data, {"nemotron": (9.12, 2_777_998), "q38": (30.33, 953_661)})
    result = json.loads(json.dumps(planner.plan(make_host(data)).as_dict()))
    assert result["host"] == "spark"
    assert result["used_gib"] == pytest.approx(84.7)
    engines = {e["name"]: e for e in result["engines"]}
    assert engines["nemotron"]["pool_tokens"] == 2_777_998
    assert engines["q38"]["concurrency"] == pytest.approx(953_661 / 131_072)
    assert set(result["split"]["utilization"]) == {"nemotron", "q38"}


def test_mamba_cache_blocks_by_vllms_page_rules(seed_data, make_host):
    """Nemotron-H: one sequence's Mamba-2 state per layer is conv (kernel-1) x (heads x head_dim
    + 2 x groups x state) in bf16 plus SSM heads x head_dim x state in float32. The attention
    block grows until a page holds it; 6 attention and 23 Mamba layers share blocks in groups of
    6, and every block id can hold one sequence's state."""
    state = (4 - 1) * (64 * 64 + 2 * 8 * 128) * 2 + 64 * 64 * 128 * 4
    token_bytes = 2 * 2 * 128 * 1  # KV heads x (K+V) x head_dim x fp8
    block_tokens = -(-state // (token_bytes * 16)) * 16  # ceil to a multiple of 16
    expected = int(9.12 * 2**30 // (block_tokens * token_bytes * 6))
    nemotron = eng(seed_data, "nemotron")
    nemotron.update(model_config_path="nemotron_h_mamba.json", kv_cache_dtype="fp8", measured={"kv_cache_gib": 9.12})
    plan = by_name(planner.plan(make_host(seed_data)))["nemotron"]
    assert plan.state_blocks == expected == 763
    assert by_name(planner.plan(make_host(seed_data)))["q38"].state_blocks is None  # no config.json


def test_max_num_seqs_above_the_mamba_blocks_is_refused(seed_data, problems_of):
    eng(seed_data, "nemotron").update(
        model_config_path="nemotron_h_mamba.json",
        kv_cache_dtype="fp8",
        measured={"kv_cache_gib": 0.5},
        max_num_seqs=128,
    )
    (problem,) = problems_of(seed_data)
    assert (problem.engine, problem.field, problem.value) == ("nemotron", "max_num_seqs", 128)
    assert "41 Mamba cache blocks" in problem.message and "at most 41" in problem.fix  # 0.5 GiB // 12.2 MiB
