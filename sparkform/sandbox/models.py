"""Tiny, real checkpoints that vLLM's CPU build serves, built in code and byte-for-byte
deterministic.

The sandbox must download and serve real checkpoints without reaching any hub, so each one is
built here: config.json, generation_config.json, a byte-level BPE tokenizer trained on a fixed
corpus, and safetensors weights from a counter-mode hash stream. The hash stream (SHAKE-256 of
the tensor's name) instead of a seeded RNG keeps the bytes independent of numpy's generator
versions, and building into a fresh folder with sorted JSON keeps every file's sha256 the same
on every build, so the fake hub's commit ids are stable too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from sparkform.sandbox.system import locked

PAD, BOS, EOS, END_OF_TURN = "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, END_OF_TURN, *ROLE_TOKENS]  # ids 0..6, in this order

# A minimal chat format: vLLM renders it for /v1/chat/completions (string content per message).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|eot|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

MAX_POSITIONS = 4096
WEIGHT_SCALE = 0.02 * 3**0.5  # uniform(-a, a) with a standard deviation of 0.02


@dataclass(frozen=True)
class ModelSpec:
    """The shape of one tiny decoder-only model."""

    architecture: str
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool
    qk_norm: bool  # Qwen3 normalizes q and k per head
    shards: int  # >1 splits the weights so multi-file downloads are exercised


# One row per architecture (a table: the formatter leaves it aligned).
# fmt: off
SPECS: dict[str, ModelSpec] = {
    # The sandbox's engine is vLLM's CPU build, whose attention accepts head sizes 32, 64, 80, ...
    "llama": ModelSpec("LlamaForCausalLM", "llama", hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2,
                       head_dim=32, vocab=1024, tie_embeddings=False, qk_norm=False, shards=1),
    "qwen3": ModelSpec("Qwen3ForCausalLM", "qwen3", hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2,
                       head_dim=64, vocab=2048, tie_embeddings=True, qk_norm=True, shards=2),
}
# fmt: on

TINY_MODELS: dict[str, str] = {"sparkform-test/tiny-llama": "llama", "sparkform-test/tiny-qwen3": "qwen3"}


# --- files ------------------------------------------------------------------------------------


def write_json(path: Path, data: Any) -> None:
    """JSON with sorted keys and a trailing newline: the same bytes on every build."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def model_config(spec: ModelSpec) -> dict[str, Any]:
    """config.json in the Hugging Face layout for `spec`."""
    config = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": MAX_POSITIONS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
    }
    if spec.model_type == "llama":
        config["mlp_bias"] = False
    return config


def generation_config() -> dict[str, Any]:
    """generation_config.json: generation stops at end of text or end of a chat turn."""
    return {
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": [SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(END_OF_TURN)],
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
    }


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json for transformers' PreTrainedTokenizerFast, with the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,  # keeps decode(encode(text)) == text
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(index): {
                "content": token,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for index, token in enumerate(SPECIAL_TOKENS)
        },
    }


# --- tokenizer --------------------------------------------------------------------------------

FIXED_TEXT = """\
The sandbox rehearses a deploy before it touches a Spark. Two engines serve two models around
the clock, each under systemd, each with its own port, cache and memory limit. A health check
answers with status 200 when the engine is ready; while it loads, the port refuses connections.
Hello, world! How are you today? I am fine, thank you. What time is it? It is 12:45 pm.
def main(argv: list[str]) -> int:
    return 0  # {"model": "tiny", "max_tokens": 16, "temperature": 0.0}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536. Ünïcödé: café, naïve, 東京, 🙂.
"""
CONSONANTS = "bcdfghklmnprstvwz"
VOWELS = "aeiou"


def lcg_stream(seed: int):
    """An endless stream of 32-bit numbers from a 64-bit linear congruential generator
    (pure Python, so the corpus never depends on a library's RNG)."""
    state = seed
    while True:
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        yield state >> 32


def corpus(lines: int = 4000) -> list[str]:
    """The fixed training corpus: FIXED_TEXT plus pseudo-word sentences with skewed word
    frequencies, rich enough for a few thousand BPE merges."""
    numbers = lcg_stream(seed=20240901)
    syllables = [c + v for c in CONSONANTS for v in VOWELS]
    words = [
        "".join(syllables[next(numbers) % len(syllables)] for _ in range(2 + next(numbers) % 3)) for _ in range(3000)
    ]
    sentences = FIXED_TEXT.splitlines()
    for _ in range(lines):
        # min() of two draws favours low indices: some words are common, most are rare.
        picks = [words[min(next(numbers), next(numbers)) % len(words)] for _ in range(8)]
        sentences.append(" ".join(picks).capitalize() + f" {next(numbers) % 1000}.")
    return sentences


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens, SPECIAL_TOKENS first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        # Fewer tokens than the embedding rows would let the model sample undecodable ids.
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    return tokenizer


# --- weights ----------------------------------------------------------------------------------


def tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every weight tensor's Hugging Face name and shape."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab, spec.hidden)}
    q_width, kv_width = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    for layer in range(spec.layers):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (spec.hidden,),
            f"{prefix}.self_attn.q_proj.weight": (q_width, spec.hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_width, spec.hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_width, spec.hidden),
            f"{prefix}.self_attn.o_proj.weight": (spec.hidden, q_width),
            f"{prefix}.post_attention_layernorm.weight": (spec.hidden,),
            f"{prefix}.mlp.gate_proj.weight": (spec.intermediate, spec.hidden),
            f"{prefix}.mlp.up_proj.weight": (spec.intermediate, spec.hidden),
            f"{prefix}.mlp.down_proj.weight": (spec.hidden, spec.intermediate),
        }
        if spec.qk_norm:
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (spec.head_dim,)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (spec.head_dim,)
    shapes["model.norm.weight"] = (spec.hidden,)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab, spec.hidden)
    return shapes


def tensor_values(kind: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Norm weights are ones; every other tensor is uniform(-WEIGHT_SCALE, WEIGHT_SCALE) from
    SHAKE-256 of the kind and tensor name."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    count = int(np.prod(shape))
    raw = hashlib.shake_256(f"sparkform-tiny/{kind}/{name}".encode()).digest(4 * count)
    # The top 24 bits of each little-endian word give exact float32 values in [0, 1).
    unit = (np.frombuffer(raw, dtype="<u4") >> 8).astype(np.float64) / 2**24
    return ((unit * 2 - 1) * WEIGHT_SCALE).astype(np.float32).reshape(shape)


def shard_names(spec: ModelSpec) -> list[str]:
    """The safetensors file names, in the Hugging Face naming scheme."""
    if spec.shards == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{spec.shards:05d}.safetensors" for i in range(1, spec.shards + 1)]


def write_weights(kind: str, spec: ModelSpec, out_dir: Path) -> None:
    """The weights as safetensors; several shards get model.safetensors.index.json."""
    shapes = tensor_shapes(spec)
    names = list(shapes)
    files = shard_names(spec)
    per_shard = -(-len(names) // len(files))  # ceil: contiguous runs of tensors per shard
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for index, file_name in enumerate(files):
        chunk = names[index * per_shard : (index + 1) * per_shard]
        tensors = {name: tensor_values(kind, name, shapes[name]) for name in chunk}
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(chunk, file_name)
        total_bytes += sum(tensor.nbytes for tensor in tensors.values())
    if len(files) > 1:
        write_json(
            out_dir / "model.safetensors.index.json",
            {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
        )


# --- checkpoints ------------------------------------------------------------------------------


def build_checkpoint(kind: str, out_dir: Path) -> Path:
    """Build the tiny checkpoint `kind` (a key of SPECS) into `out_dir`, which must be empty or
    absent (stale files would break determinism). Returns `out_dir`."""
    spec = SPECS[kind]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty")
    write_json(out_dir / "config.json", model_config(spec))
    write_json(out_dir / "generation_config.json", generation_config())
    write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    (out_dir / "tokenizer.json").write_text(train_tokenizer(spec.vocab).to_str(pretty=True) + "\n")
    write_weights(kind, spec, out_dir)
    return out_dir


def build_fingerprint(kind: str) -> str:
    """What a build of `kind` depends on (this file and the libraries that write the bytes),
    hashed: a cached build with the same fingerprint has the same bytes."""
    parts = [kind, Path(__file__).read_text()]
    parts += [f"{lib}=={version(lib)}" for lib in ("tokenizers", "safetensors", "numpy")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cached_checkpoint(kind: str, cache_dir: Path) -> Path:
    """`<cache_dir>/<kind>-<fingerprint>`, built once (into a temp folder renamed when done; a lock
    beside it makes a second process wait for the first one's build)."""
    final = Path(cache_dir) / f"{kind}-{build_fingerprint(kind)}"
    if final.is_dir():
        return final
    with locked(final.with_name(f".{final.name}.lock")):
        if not final.is_dir():  # else another process built it while this one waited
            staging = final.with_name(f".{final.name}.partial")
            if staging.exists():
                for stale in staging.iterdir():
                    stale.unlink()
            build_checkpoint(kind, staging)
            staging.rename(final)
    return final
