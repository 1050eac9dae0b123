"""Convert a Llama-family GGUF file into the engine's own checkpoint directory (once, then cached).

The output is a Hugging Face style directory (config.json, model.safetensors in float32, tokenizer files
with the chat template), so the engine has one loading path for everything it runs.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    p = f"{arch}."
    hidden = int(_field(reader, p + "embedding_length"))
    heads = int(_field(reader, p + "attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "vocab_size": int(vocab), "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32", "hidden_act": "silu",
    }


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its RoPE; undo that to the HF (rotate_half) layout."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        if kind not in _LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    if base not in _TOP_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{_TOP_NAMES[base]}.{suffix}"


def _convert_tensors(reader, cfg) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize
    tensors = {}
    for t in tqdm(reader.tensors, desc="converting GGUF", unit="tensor"):
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        tensors[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return tensors


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the converted checkpoint to out_dir atomically (a crash leaves no half directory)."""
    import gguf
    from transformers import AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    cfg = _hf_config(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        save_file(_convert_tensors(reader, cfg), str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tok.save_pretrained(str(tmp))
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
