"""Weights into the engine's model: Hugging Face safetensors (fusing QKV and gate/up) or random dummies."""
from __future__ import annotations

import glob

import torch
from safetensors import safe_open

from engine.models.loader import ModelSource
from engine.models.llama import LlamaForCausalLM

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def build_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
                max_positions: int) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(source.config)
    model = model.to_empty(device=device).to(dtype)
    if source.path is None:
        _init_dummy(model, seed=0)
    else:
        _load_safetensors(model, source)
    model.init_rope(max_positions, device)
    return model.eval().requires_grad_(False)


def _init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.endswith(".bias"):
            p.data.zero_()
        else:
            p.data.normal_(0.0, 0.02, generator=gen)


def _target(model_params: dict, hf_name: str):
    """Map an HF tensor name to (engine parameter, fused kind or None, part index)."""
    parts = hf_name.removeprefix("model.").split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, idx = _FUSED[parts[-2]]
        parts[-2] = fused
        return model_params.get(".".join(parts)), fused, idx
    return model_params.get(".".join(parts)), None, 0


def _load_safetensors(model: LlamaForCausalLM, source: ModelSource) -> None:
    params = dict(model.named_parameters())
    attn = model.layers[0].self_attn
    splits = {"qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size],
              "gate_up_proj": [model.layers[0].mlp.inter] * 2}
    loaded = set()
    for file in sorted(glob.glob(str(source.path / "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for hf_name in f.keys():
                if "rotary_emb" in hf_name or (model.tied and hf_name == "lm_head.weight"):
                    continue
                param, fused, idx = _target(params, hf_name)
                if param is None:
                    raise ValueError(f"{source.path}: unexpected tensor {hf_name!r}")
                sizes = splits[fused] if fused else [param.shape[0]]
                _copy_into(param, f.get_tensor(hf_name), sizes, idx, hf_name)
                loaded.add(id(param))
    missing = [n for n, p in params.items() if id(p) not in loaded]
    if missing:
        raise ValueError(f"{source.path}: checkpoint lacks {missing[:4]}{'...' if len(missing) > 4 else ''}")


def _copy_into(param, tensor, sizes, idx, hf_name):
    start = sum(sizes[:idx])
    dst = param.data[start:start + sizes[idx]]
    if dst.shape != tensor.shape:
        raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(tensor)
