"""The persistent decode stack's launch: which models and steps it runs, its weights as one tensor per kind, and
a step's plan (tile sizes, KV splits, programs).

    stack = DecodeStack(model, kv_caches)         # stacks the layers' weights in place (no second copy)
    hidden = stack(x, positions, meta)            # = the model's final norm output for a decode step of <= 4 rows

The kernel (engine/kernels/persistent/decode_stack.py) walks layer l's weights at a fixed offset from layer 0's,
so each kind of weight (QKV, o_proj, gate_up, down, the two norms) must be one [layers, ...] tensor. The loader
makes them so (engine/models/weights.py stack_layers); for a model built otherwise the constructor copies them
into one and points every layer's parameter at its slice.
"""
from __future__ import annotations

import torch
import triton

from engine.kernels.attention.attention_checks import check_unit_stride
from engine.kernels.attention.paged_attention import _LOG2E, _tile_config
from engine.kernels.attention.split_merge import split_count
from engine.kernels.common import sm_count
from engine.kernels.persistent import MAX_ROWS, decode_stack as ds
from engine.kernels.persistent.weights import stack_params

MIN_TILE = 4            # output columns a matmul task takes at least
PRODUCT = 8192          # elements of a task's [rows, tile, chunk] product per chunk (registers)
NUM_WARPS = 4


def unsupported(model) -> str | None:
    """Why the stack cannot run `model`, or None."""
    attn = model.layers[0].self_attn
    if model.tp.world != 1:
        return "tensor parallelism (the stack runs one GPU's whole model)"
    if attn.qk_norm:
        return "QK norm (Qwen3)"
    if attn.head_dim % 2:
        return f"an odd head size ({attn.head_dim})"
    return None


def kv_layer_stride(kv_caches) -> int:
    """Elements from layer l's K (and V) cache to layer l + 1's: the caches must be views of one buffer at a
    fixed stride (engine/memory/kv_cache.py kv_pages makes them so)."""
    k0, v0 = kv_caches[0]
    if k0.stride() != v0.stride() or not k0.is_contiguous():
        raise ValueError("the decode stack needs contiguous K and V caches of one layout")
    if len(kv_caches) == 1:
        return 0
    stride = (kv_caches[1][0].data_ptr() - k0.data_ptr()) // k0.element_size()
    for layer, (k, v) in enumerate(kv_caches):
        if (k.data_ptr() - k0.data_ptr() != layer * stride * k0.element_size()
                or v.data_ptr() - v0.data_ptr() != layer * stride * k0.element_size()):
            raise ValueError("the decode stack needs every layer's KV cache in one buffer at a fixed stride")
    return stride


def stack_plan(dims, rows: int, splits: int, block_size: int, programs: int, product: int = PRODUCT) -> dict:
    """The kernel's constexprs for a step of `rows` rows of a model of dims (hidden, intermediate, heads, KV heads,
    head size): each matmul stage's output tile (about one task a program) and weight chunk (`product` elements of
    the [rows, tile, chunk] product), and the attention's tiles."""
    hidden, inter, heads, kv_heads, head_dim = dims
    block_m, _, tile_n, _ = _tile_config(heads // kv_heads, 1, block_size)
    r_pad = triton.next_power_of_2(rows)
    plan = dict(ROWS=rows, R_PAD=r_pad, SPLITS=splits, BLOCK_M=block_m, TILE_N=tile_n)
    for stage, n, k in (("QKV", (heads + 2 * kv_heads) * head_dim, hidden), ("O", hidden, heads * head_dim),
                        ("GU", inter, hidden), ("D", hidden, inter)):
        per = max(MIN_TILE, n // programs)
        tile = 1 << (per.bit_length() - 1)
        plan[f"BN_{stage}"] = tile
        plan[f"BK_{stage}"] = max(32, min(triton.next_power_of_2(k), product // (r_pad * tile)))
    return plan


class DecodeStack:
    def __init__(self, model, kv_caches, programs: int | None = None, num_warps: int = NUM_WARPS,
                 product: int = PRODUCT, aux_layers=()):
        """programs: the persistent grid (default one an SM; one in the interpreter); num_warps, product: a
        program's warps and the elements of its [rows, tile, chunk] product a weight chunk (its chunk size);
        aux_layers: the layers whose outputs a call with aux=True returns too, in this order (a draft head's)."""
        reason = unsupported(model)
        if reason:
            raise ValueError(f"the persistent decode stack does not run this model: {reason}")
        layers, cfg = model.layers, model.cfg
        attn, mlp = [la.self_attn for la in layers], [la.mlp for la in layers]
        self.model, self.kv_caches = model, kv_caches
        self.w_qkv = stack_params([a.qkv_proj.weight for a in attn])
        self.b_qkv = stack_params([a.qkv_proj.bias for a in attn]) if attn[0].qkv_proj.bias is not None else None
        self.w_o = stack_params([a.o_proj.weight for a in attn])
        self.w_gu = stack_params([m.gate_up_proj.weight for m in mlp])
        self.w_d = stack_params([m.down_proj.weight for m in mlp])
        self.n_in = stack_params([la.input_layernorm.weight for la in layers])
        self.n_post = stack_params([la.post_attention_layernorm.weight for la in layers])
        self.eps = float(cfg["rms_norm_eps"])
        self.heads, self.kv_heads, self.head_dim = attn[0].num_heads, attn[0].num_kv_heads, attn[0].head_dim
        self.hidden, self.inter = cfg["hidden_size"], mlp[0].inter
        self.kv_stride = kv_layer_stride(kv_caches)
        device = self.w_qkv.device
        if programs is None:
            programs = 1 if ds.interpreted() or device.type != "cuda" else sm_count(device)
        if ds.interpreted() and programs != 1:
            raise ValueError("the interpreter runs one program at a time: a persistent grid of more would wait forever")
        self.programs, self.num_warps, self.product = programs, num_warps, product
        self.max_rows = MAX_ROWS
        # the stage counters and the exit count (zero between launches), then the KV splits' merge tickets
        self.counters = torch.zeros(len(layers) * ds.STAGES.value + 1, dtype=torch.int32, device=device)
        self.tickets = torch.zeros(MAX_ROWS * self.kv_heads, dtype=torch.int32, device=device)
        # each asked layer's slot in the kernel's aux output (-1: none), and the slots in the order asked
        self.aux_layers = tuple(aux_layers)
        unique = sorted(set(self.aux_layers))
        if any(not 0 <= layer < len(layers) for layer in unique):
            raise ValueError(f"aux_layers {self.aux_layers} name layers the model does not have ({len(layers)})")
        self.aux_map = torch.tensor([unique.index(i) if i in unique else -1 for i in range(len(layers))],
                                    dtype=torch.int32, device=device)
        self.aux_order = [unique.index(layer) for layer in self.aux_layers]

    def plan(self, rows: int, block_size: int, block_tables, num_splits=None) -> dict:
        """The kernel's constexprs for a step of `rows` rows. The KV splits follow the block tables' capacity, not
        the step's context bound: one compiled variant serves every context of a row count (a split past a short
        context has no keys and costs its program little), where the graphs of each context bound would each
        compile one."""
        tile_n = _tile_config(self.heads // self.kv_heads, 1, block_size)[2]
        splits = split_count(num_splits, self.w_qkv.device, rows * self.kv_heads, block_tables, block_size, None,
                             tile_n)
        dims = (self.hidden, self.inter, self.heads, self.kv_heads, self.head_dim)
        return stack_plan(dims, rows, splits, block_size, self.programs, self.product)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta, aux: bool = False, num_splits=None):
        """The final norm's output [rows, hidden] of a step of `rows` tokens (a decode step's, or a verification
        step's of several tokens a sequence) whose embedded inputs are x [rows, hidden]; x is overwritten (it holds
        each layer's output in turn). Stores the new keys and values. aux: also the aux layers' outputs, as
        [rows, len(aux_layers) * hidden] (the model's forward returns the same pair)."""
        rows = x.shape[0]
        self._check(x, positions, meta)
        model, (k_cache, v_cache) = self.model, self.kv_caches[0]
        block_size = k_cache.shape[1]
        p = self.plan(rows, block_size, meta.block_tables, num_splits)
        head_pad = max(16, triton.next_power_of_2(self.head_dim))
        dev, dtype = x.device, x.dtype
        qs = self.heads * self.head_dim
        qkv = torch.empty((rows, qs + 2 * self.kv_heads * self.head_dim), dtype=dtype, device=dev)
        attn = torch.empty((rows, qs), dtype=dtype, device=dev)
        ha = torch.empty_like(x)
        act = torch.empty((rows, self.inter), dtype=dtype, device=dev)
        out = torch.empty_like(x)
        parts = rows * self.heads * p["SPLITS"]
        part_acc = torch.empty((parts, head_pad), dtype=torch.float32, device=dev)
        part_m, part_l = torch.empty((2, parts), dtype=torch.float32, device=dev).unbind(0)
        bias = self.b_qkv if self.b_qkv is not None else self.w_qkv
        if aux and not self.aux_layers:
            raise ValueError("this decode stack was built without aux_layers")
        slots = torch.empty((len(set(self.aux_layers)) if aux else 0, rows, self.hidden), dtype=dtype, device=dev)
        ds.decode_stack_kernel[(self.programs,)](
            x, ha, qkv, attn, act, out, self.counters, self.tickets, part_acc, part_m, part_l,
            self.w_qkv, bias, self.w_o, self.w_gu, self.w_d, self.n_in, self.n_post, model.norm.weight,
            k_cache, v_cache, self.kv_stride, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, positions,
            meta.slot_mapping, model.cos_cache, model.sin_cache, slots if aux else out, self.aux_map, self.eps,
            self.head_dim ** -0.5 * _LOG2E,
            meta.block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            model.cos_cache.stride(0),
            LAYERS=len(model.layers), H=self.hidden, INTER=self.inter, NH=self.heads, KVH=self.kv_heads,
            HEAD_DIM=self.head_dim, HEAD_PAD=head_pad, GROUP=self.heads // self.kv_heads, BLOCK_SIZE=block_size,
            SEQS=meta.seq_lens.shape[0], HAS_BIAS=self.b_qkv is not None, AUX=aux,
            PRECISION="ieee" if dtype == torch.float32 else "tf32", num_warps=self.num_warps, **p)
        return (out, torch.cat([slots[i] for i in self.aux_order], dim=-1)) if aux else out

    def _check(self, x, positions, meta) -> None:
        rows = x.shape[0]
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"the decode stack runs steps of 1 to {MAX_ROWS} rows, got {rows}")
        if x.dim() != 2 or x.shape[1] != self.hidden or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous [rows, {self.hidden}] tensor, got {tuple(x.shape)}")
        if x.dtype != self.w_qkv.dtype:
            raise ValueError(f"x is {x.dtype}, the weights {self.w_qkv.dtype}")
        seqs = meta.seq_lens.shape[0]
        if positions.shape[0] != rows or meta.slot_mapping.shape[0] != rows or not 1 <= seqs <= rows \
                or meta.cu_seqlens_q.shape[0] != seqs + 1 or meta.block_tables.shape[0] != seqs:
            raise ValueError(f"a step of {rows} tokens needs as many positions and slots, and 1 to {rows} sequences "
                             "with their cu_seqlens_q and block tables")
        if meta.tree_masks is not None:
            raise ValueError("the decode stack does not verify draft trees")
        for name, t in (("positions", positions), ("slot_mapping", meta.slot_mapping),
                        ("cu_seqlens_q", meta.cu_seqlens_q), ("seq_lens", meta.seq_lens)):
            check_unit_stride(name, t)
        if meta.block_tables.stride(1) != 1:
            raise ValueError("the decode stack needs block tables contiguous along their pages")
