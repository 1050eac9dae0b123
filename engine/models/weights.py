"""Weights into the engine's model: Hugging Face safetensors (fusing QKV and gate/up) or random dummies.

Each kind of layer weight (QKV, o_proj, gate_up, down, the two norms) is one [layers, ...] tensor whose slices
are the layers' parameters (stack_layers), so a kernel can walk layer l's weights at a fixed offset from layer
0's (engine/kernels/persistent/decode_stack.py); every other path sees one parameter a layer, as before.

With tensor parallelism each rank reads only its part of every tensor (safetensors slices; a GGUF is read
from the directory it was converted to) and no rank holds the whole model (engine/parallel/sharding.py).
"""
from __future__ import annotations

import torch
from safetensors import safe_open

from engine.kernels.persistent.weights import stack_params
from engine.models.loader import ModelSource, weight_files
from engine.models.llama import LlamaForCausalLM
from engine.parallel.group import SINGLE
from engine.parallel.sharding import ParamShard, param_shards

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def build_model(source: ModelSource, dtype: torch.dtype, device: torch.device, max_positions: int,
                tp=SINGLE) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(source.config, tp)
    model = model.to_empty(device=device).to(dtype)
    stack_layers(model, copy=False)                 # (nothing loaded yet)
    shards = param_shards(source.config, tp.rank, tp.world)
    if source.path is None:
        _init_dummy(model, shards, seed=0)
    else:
        _load_safetensors(model, source, shards)
    model.init_rope(max_positions, device)
    return model.eval().requires_grad_(False)


LAYER_WEIGHTS = ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias", "self_attn.o_proj.weight",
                 "mlp.gate_up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight")


def stack_layers(model: LlamaForCausalLM, copy: bool = True) -> None:
    """Every kind of LAYER_WEIGHTS as one tensor, each layer's parameter a slice of it (values kept where `copy`)."""
    for name in LAYER_WEIGHTS:
        params = [_param(layer, name) for layer in model.layers]
        if all(isinstance(p, torch.nn.Parameter) for p in params):    # (a bias the model has not: None)
            stack_params(params, copy)


def _param(module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part, None)
    return module


def _init_dummy(model: LlamaForCausalLM, shards: dict[str, ParamShard] | None = None, seed: int = 0) -> None:
    """Random weights, the same model for any rank count: a cut weight is drawn whole (one at a time, in the
    same order as unsharded) and this rank keeps its part."""
    gen, shards = torch.Generator(device=next(model.parameters()).device).manual_seed(seed), shards or {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.endswith(".bias"):
            p.data.zero_()
        elif name in shards:
            shard = shards[name]
            full = torch.empty(shard.full_shape(p.shape), dtype=p.dtype,
                               device=p.device).normal_(0.0, 0.02, generator=gen)
            shard.take(full, p.data)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)


def _target(hf_name: str):
    """Map an HF tensor name to (engine parameter name, part index, fused kind or None)."""
    parts = hf_name.removeprefix("model.").split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, idx = _FUSED[parts[-2]]
        parts[-2] = fused
        return ".".join(parts), idx, fused
    return ".".join(parts), 0, None


def _load_safetensors(model: LlamaForCausalLM, source: ModelSource, shards: dict[str, ParamShard]) -> None:
    params = dict(model.named_parameters())
    attn = model.layers[0].self_attn
    splits = {"qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size],
              "gate_up_proj": [model.layers[0].mlp.inter] * 2}
    loaded = set()
    for file in weight_files(source.path):
        with safe_open(file, framework="pt") as f:
            for hf_name in f.keys():
                if "rotary_emb" in hf_name or (model.tied and hf_name == "lm_head.weight"):
                    continue
                name, idx, fused = _target(hf_name)
                param = params.get(name)
                if param is None:
                    raise ValueError(f"{source.path}: unexpected tensor {hf_name!r}")
                if name in shards:
                    _copy_part(param, f.get_slice(hf_name), shards[name], idx, hf_name)
                else:
                    sizes = splits[fused] if fused else [param.shape[0]]
                    _copy_into(param, f.get_tensor(hf_name), sizes, idx, hf_name)
                loaded.add(id(param))
    missing = [n for n, p in params.items() if id(p) not in loaded]
    if missing:
        raise ValueError(f"{source.path}: checkpoint lacks {missing[:4]}{'...' if len(missing) > 4 else ''}")


def _copy_into(param, tensor, sizes, idx, hf_name):
    start = sum(sizes[:idx])
    dst = param.data[start:start + sizes[idx]]
    _check_shape(dst, tensor, hf_name)
    dst.copy_(tensor)


def _copy_part(param, tensor_slice, shard: ParamShard, idx: int, hf_name: str) -> None:
    """Read only this rank's [start, stop) of part `idx` along the shard's dimension."""
    size, start, stop = shard.parts[idx]
    full = tuple(tensor_slice.get_shape())
    if len(full) <= shard.dim or full[shard.dim] != size:
        raise ValueError(f"tensor {hf_name!r} has shape {full}, expected {size} along dimension {shard.dim}")
    tensor = tensor_slice[start:stop] if shard.dim == 0 else tensor_slice[:, start:stop]
    dst = param.data.narrow(shard.dim, shard.offset(idx), stop - start)
    if idx == 0 and shard.rows:                 # vocabulary padding rows stay zero
        param.data.zero_()
    _check_shape(dst, tensor, hf_name)
    dst.copy_(tensor)


def _check_shape(dst, tensor, hf_name):
    if dst.shape != tensor.shape:
        raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
