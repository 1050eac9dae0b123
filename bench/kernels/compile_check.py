"""Compile the decode-step kernels that are off by default or new for Hopper (sm_90), without a GPU.

    python -m bench.kernels.compile_check    # prints one line per variant; exit status 1 if any fails

The CPU interpreter runs a kernel's semantics but never lowers it: layouts, register pressure, and PDL
instructions are only met when compiling. This compiles each variant at the default model's shapes, through
Triton's own ptxas. Per variant it reports the registers a thread, local memory (spills), shared memory, and
whether the PTX holds the dependent-launch instructions (griddepcontrol) exactly when USE_PDL is on, and which
tensor-core instruction it holds (mma.sync, or Hopper's warpgroup wgmma). Every variant compiles with USE_PDL on;
with it off, the first variant of each kernel (the switch is one branch of a kernel, not of its shapes) and the
kernels that take no switch. Arguments are specialized as the JIT specializes a launch (pointers and multiples of
16 marked divisible by 16), so loads are vectorized as on the GPU.
The installed Triton may differ from the GPU machine's, so a pass here is a first check, not a GPU run.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"        # JIT functions, not the interpreter's

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.kernels.sampling import argmax, topk  # noqa: E402
from engine.kernels.attention import decode_attention, paged_attention  # noqa: E402
from engine.kernels.matmul import decode_gemm, decode_gemv, head_mma, stream_gemm  # noqa: E402
from engine.kernels.speculative import head_ops, ngram_draft, spec_finish, spec_ops, tree_finish  # noqa: E402
from engine.kernels import step_io  # noqa: E402
from engine.kernels.persistent import decode_stack, stack  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_BF16_PTRS = ("x_ptr", "res_ptr", "nw_ptr", "w_ptr", "out_ptr", "new_res_ptr", "add_ptr")
_GEMV_ARGS = dict(idx_ptr="*i32", stride_x="i32", stride_res="i32", stride_out="i32", stride_new_res="i32",
                  stride_add="i32", M="i32", N="i32", K="i32", eps="fp32")


def _gemv_types(epilogue: str) -> dict:
    types = {p: "*bf16" for p in _BF16_PTRS} | _GEMV_ARGS
    return types | ({"out_ptr": "*fp32"} if epilogue == "argmax" else {})


def _shapes(m, k, n, prologue) -> dict:
    """The integer arguments of a GEMV or GEMM call on contiguous tensors, as the JIT sees them."""
    stride_x = 2 * k if prologue == "silu" else k
    return dict(stride_x=stride_x, stride_res=k, stride_out=n, stride_new_res=k, stride_add=n, M=m, N=n, K=k)


def _gemm(m, k, n, prologue, epilogue, pdl, decode=False, **over):
    cfg = decode_gemm.decode_gemm_config(m, n, k, decode) | over
    k0, k1 = decode_gemm.pieces(k)
    consts = dict(PROLOGUE=prologue, HAS_RESIDUAL=prologue == "norm", EPILOGUE=epilogue, BLOCK_M=cfg["BLOCK_M"],
                  GROUPS=cfg["GROUPS"], BLOCK_N=cfg["BLOCK_N"], K0=k0, BK0=min(cfg["BLOCK_K"], k0),
                  K1=k1, BK1=min(cfg["BLOCK_K"], max(k1, 16)), UPCAST=False, PRECISION="tf32", USE_PDL=pdl)
    extra = (" decode" if decode else "") + "".join(f" {key}={value}" for key, value in over.items())
    return (f"decode_gemm M={m} K={k} N={n} {prologue}/{epilogue}{extra}", decode_gemm._decode_gemm_kernel,
            _gemv_types(epilogue), consts, cfg["num_warps"],
            _shapes(m, k, n // 2 if epilogue == "silu_mul" else n, prologue))   # silu_mul: N weight rows, N / 2 out


def _gemv(k, n, prologue, epilogue, pdl, m=1):
    cfg = decode_gemv.decode_gemv_config(n, k, m)
    consts = dict(PROLOGUE=prologue, HAS_RESIDUAL=prologue == "norm", EPILOGUE=epilogue, BLOCK_N=cfg["BLOCK_N"],
                  BLOCK_K=cfg["BLOCK_K"], ROWS=cfg["ROWS"], USE_PDL=pdl)
    return (f"decode_gemv M={m} K={k} N={n} {prologue}/{epilogue}", decode_gemv._decode_gemv_kernel,
            _gemv_types(epilogue), consts, cfg["num_warps"], _shapes(m, k, n, prologue))


def _stream(m, k, n, prologue, epilogue, pdl, variant="base"):
    """stream_gemm.py's kernel at its launch config (Llama 1B's shapes): the base launch with its weight slice
    prefetched into L2, or another variant's without."""
    cfg = stream_gemm.config(m, n, k, variant=variant)
    warps, k_split = cfg.pop("num_warps"), cfg.pop("K_SPLIT")
    consts = dict(cfg, PROLOGUE=prologue, HAS_RESIDUAL=prologue == "norm", EPILOGUE=epilogue, USE_PDL=pdl,
                  PRECISION="tf32", L2_AHEAD=variant == "base")
    types = {p: "*bf16" for p in _BF16_PTRS if p != "add_ptr"} | dict(
        part_ptr="*fp32", cnt_ptr="*i32", stride_x="i32", stride_res="i32", stride_w="i32", stride_out="i32",
        stride_new_res="i32", M="i32", N="i32", K="i32", K_SPLIT="i32", eps="fp32")
    out = n // 2 if epilogue == "silu_mul" else n
    name = f"stream_gemm{'' if variant == 'base' else ' ' + variant} M={m} K={k} N={n} {prologue}/{epilogue}"
    return (name, stream_gemm._stream_gemm_kernel, types, consts, warps,
            dict(stride_x=k, stride_res=k, stride_w=k, stride_out=out, stride_new_res=k, M=m, N=out, K=k,
                 K_SPLIT=k_split))


def _head_mma(m, pdl, v=49152, k=576):
    """head_mma.py's kernel at its launch config for m rows of the default model's LM head."""
    cfg = head_mma.head_config(m, v, k)
    block_v, warps = cfg.pop("BLOCK_V"), cfg.pop("num_warps")
    cfg.pop("num_stages")                       # Triton's default (3) for CUDA
    consts = dict(BLOCK_V=block_v, BLOCK_T=head_mma.block_t(m), UPCAST=False, PRECISION="tf32",
                  USE_PDL=pdl, **cfg)
    types = dict(x_ptr="*bf16", w_ptr="*bf16", val_ptr="*fp32", idx_ptr="*i32", stride_x="i32", P="i32", M="i32",
                 V="i32", K="i32")
    return (f"head_mma M={m} K={k} V={v}", head_mma._head_mma_kernel, types, consts, warps,
            dict(stride_x=k, P=triton.cdiv(v, block_v), M=m, V=v, K=k))


# the argument types of both attention kernels (paged_attention.py's and decode_attention.py's take the same names)
_ATTENTION_TYPES = ({p: "*bf16" for p in ("q_ptr", "kc_ptr", "vc_ptr", "out_ptr", "kn_ptr", "vn_ptr")}
                    | {p: "*fp32" for p in ("part_acc", "part_m", "part_l", "cos_ptr", "sin_ptr")}
                    | {p: "*i32" for p in ("cu_q", "seq_lens", "bt_ptr", "sem_ptr")}
                    | dict(pos_ptr="*i64", slot_ptr="*i64", qk_scale="fp32")
                    | {n: "i32" for n in ("num_heads", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
                                          "stride_bt_b", "stride_bt_n", "stride_blk", "stride_pos", "stride_kvh",
                                          "stride_knt", "stride_knh", "stride_vnt", "stride_vnh", "stride_cos")})


def _attention(splits: int, rope: bool, merge: bool, pdl: bool, tree: bool = False):
    """The paged-attention kernel of a SmolLM2 decode step (9 q heads on 3 kv heads, head_dim 64, pages of 16); tree:
    a verification step of a draft tree of 8 (9 new tokens a sequence)."""
    block_m, block_q = (32, 10) if tree else (16, 5)
    consts = dict(GROUP=3, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=64, HEAD_PAD=64, BLOCK_SIZE=16, TILE_N=64,
                  NUM_SPLITS=splits, PRECISION="tf32", ROPE=rope, MERGE=merge, TREE=tree, USE_PDL=pdl)
    return (f"paged_attention splits={splits} rope={rope} merge={merge}{' tree' if tree else ''}",
            paged_attention._paged_attn_kernel, _ATTENTION_TYPES | dict(tree_ptr="*i64"), consts, 4)


def _decode_attention(splits: int, merge: bool, pdl: bool, prefetch: int = 1):
    """decode_attention.py's kernel at SmolLM2's heads (9 q heads on 3 kv heads, head_dim 64, pages of 16)."""
    consts = dict(GROUP=3, BLOCK_M=16, HEAD_DIM=64, HEAD_PAD=64, BLOCK_SIZE=16, TILE_N=64, NUM_SPLITS=splits,
                  PREFETCH=prefetch, PRECISION="tf32", MERGE=merge, USE_PDL=pdl)
    return (f"decode_attention splits={splits} merge={merge} prefetch={prefetch}", decode_attention._decode_attn_kernel,
            _ATTENTION_TYPES, consts, 4)


_STACK_TYPES = ({p: "*bf16" for p in ("h_ptr", "ha_ptr", "qkv_ptr", "attn_ptr", "act_ptr", "out_ptr", "w_qkv", "b_qkv",
                                      "w_o", "w_gu", "w_d", "n_in", "n_post", "n_final", "kc_ptr", "vc_ptr", "aux_ptr")}
                | {p: "*i32" for p in ("cnt_ptr", "sem_ptr", "cu_q", "seq_lens", "bt_ptr", "aux_map")}
                | {p: "*fp32" for p in ("part_acc", "part_m", "part_l", "cos_ptr", "sin_ptr")}
                | dict(pos_ptr="*i64", slot_ptr="*i64", kv_layer_stride="i64", eps="fp32", qk_scale="fp32")
                | {p: "i32" for p in ("stride_bt", "stride_blk", "stride_pos", "stride_kvh", "stride_cos")})


def _stack(rows: int, warps: int, product: int, seqs: int | None = None, aux: bool = False):
    """The persistent decode stack at SmolLM2's shapes on 132 programs (an H100's or H200's SMs), 2 KV splits; seqs:
    the sequences of its rows (default one a row: a decode step; fewer: a verification step)."""
    plan = stack.stack_plan((576, 1536, 9, 3, 64), rows, 2, 16, 132, product)
    consts = dict(LAYERS=30, H=576, INTER=1536, NH=9, KVH=3, HEAD_DIM=64, HEAD_PAD=64, GROUP=3, BLOCK_SIZE=16,
                  SEQS=seqs or rows, HAS_BIAS=False, AUX=aux, PRECISION="tf32", **plan)
    return (f"decode_stack rows={rows} seqs={seqs or rows} aux={aux} warps={warps} product={product}",
            decode_stack.decode_stack_kernel,
            _STACK_TYPES, consts, warps, dict(stride_bt=128, stride_blk=16 * 192, stride_pos=192, stride_kvh=64,
                                              stride_cos=64))


def variants(pdl: bool) -> list[tuple]:
    """(label, kernel, argument types, constexprs, warps) at SmolLM2-135M's shapes (hidden 576, MLP 1536,
    vocabulary 49152)."""
    i64 = ("pos_ptr", "shift_ptr", "tok_row_ptr", "tok_seq_ptr", "map_ptr", "in_ptr", "carry_ptr", "ids_ptr",
           "seq_shift_ptr", "steps_ptr", "smp_shift_ptr", "smp_row_ptr", "rejected_ptr", "last_ptr", "drafts_ptr",
           "hist_ptr", "cap_ptr", "count_ptr", "drafted_ptr")
    correct = {p: "*i64" for p in i64} | dict(bt_ptr="*i32", seq_lens_ptr="*i32", stride_bt="i32",
                                              stride_drafts="i32", stride_hist="i32", draft_cols="i32", n_rows="i32",
                                              max_model_len="i32", T="i32", B="i32", S="i32")
    finish = {p: "*i64" for p in ("ids_ptr", "drafts_ptr", "target_ptr", "drafted_ptr", "tokens_ptr", "acc_ptr",
                                   "smp_row_ptr", "last_ptr", "rejected_ptr", "out_ptr", "sampled_ptr", "li_ptr",
                                   "pos_ptr", "src_ptr", "next_ptr", "tok_seq_ptr", "row_last_ptr", "row_seq_ptr",
                                   "row_start_ptr")}
    finish |= dict(hist_ptr="*i32", row_valid_ptr="*u8") | {n: "i32" for n in (
        "stride_out", "stride_hist", "n_rows", "n_pos", "n_tok_seq", "k_max", "max_model_len", "T", "S")}
    tree = {p: "*i64" for p in ("ids_ptr", "target_ptr", "drafted_ptr", "leaf_depth_ptr", "smp_row_ptr", "li_ptr",
                                 "tok_seq_ptr", "map_ptr", "tokens_ptr", "acc_ptr", "last_tok_ptr", "rejected_ptr",
                                 "out_ptr", "sampled_ptr", "row_last_ptr", "row_seq_ptr", "head_map_ptr", "move_ptr")}
    tree |= dict(row_valid_ptr="*u8", stride_out="i32", n_rows="i32", n_tok_seq="i32", S="i32")
    layout = dict(start_ptr="*i64", seq_ptr="*i64", valid_ptr="*u8", cap_ptr="*i64", bt_ptr="*i32", pos_ptr="*i64",
                  map_ptr="*i64", lens_ptr="*i32", table_ptr="*i32", cu_ptr="*i32", last_ptr="*i64", a_ptr="*bf16",
                  a_out_ptr="*bf16", b_ptr="*bf16", b_out_ptr="*bf16", stride_bt="i32", stride_a="i32",
                  stride_b="i32", width_a="i32", width_b="i32", n_last="i32", max_blocks="i32", offset="i32",
                  max_model_len="i32", S="i32")
    return [
        _gemm(32, 576, 960, "norm", "store", pdl), _gemm(32, 576, 3072, "norm", "store", pdl),
        _gemm(32, 1536, 576, "silu", "store", pdl), _gemm(32, 1536, 576, "silu", "add", pdl, decode=True),
        _gemm(32, 576, 3072, "norm", "silu_mul", pdl, decode=True),
        _gemm(32, 1536, 576, "none", "add", pdl, decode=True),
        _gemm(8, 576, 576, "none", "store", pdl),
        _gemm(16, 576, 49152, "norm", "argmax", pdl),
        _head_mma(1, pdl), _head_mma(4, pdl), _head_mma(32, pdl),
        _stream(8, 2048, 3072, "norm", "store", pdl), _stream(8, 2048, 16384, "norm", "silu_mul", pdl),
        _stream(32, 8192, 2048, "none", "store", pdl), _stream(32, 2048, 2048, "none", "store", pdl),
        _stream(8, 8192, 2048, "none", "store", pdl, "split"), _stream(8, 2048, 3072, "norm", "store", pdl, "split"),
        _gemv(576, 49152, "norm", "argmax", pdl), _gemv(576, 49152, "none", "argmax", pdl),
        _gemv(1536, 576, "silu", "add", pdl), _gemv(576, 960, "norm", "store", pdl, m=4),
        _gemv(1536, 576, "silu", "store", pdl, m=4), _gemv(576, 49152, "none", "argmax", pdl, m=4),
        _gemv(576, 3072, "norm", "silu_mul", pdl), _gemv(576, 3072, "norm", "silu_mul", pdl, m=4),
        _gemv(4096, 28672, "norm", "silu_mul", pdl), _gemv(14336, 4096, "none", "store", pdl),
        *[(f"argmax first max ids={ids} masked={masked}", argmax._first_max_kernel,
           dict(val_ptr="*fp32", idx_ptr="*i32", ids_ptr="*i64", tok_ptr="*i64", cnt_ptr="*i32", forced_ptr="*i64",
                stride="i32", P="i32"),
           dict(BLOCK_P=argmax.BLOCK_P, HAS_IDS=ids, MASKED=masked, FORCED=masked, USE_PDL=pdl), 16)
          for ids, masked in ((False, False), (True, False), (False, True))],
        ("argmax block max", argmax._block_max_kernel, dict(x_ptr="*bf16", val_ptr="*fp32", idx_ptr="*i32",
                                                             stride_x="i32", stride_p="i32", V="i32"),
         dict(BLOCK_V=1024, USE_PDL=pdl), 4),
        ("topk block top", topk._block_top_kernel, dict(x_ptr="*bf16", val_ptr="*fp32", col_ptr="*i32",
                                                         stride_x="i32", stride_p="i32", V="i32"),
         dict(N=6, BLOCK_V=topk.BLOCK_V, USE_PDL=pdl), 4),
        ("topk merge top", topk._merge_top_kernel, dict(val_ptr="*fp32", col_ptr="*i32", ids_ptr="*i64",
                                                         tok_ptr="*i64", stride_p="i32", P="i32"),
         dict(N=6, BLOCK=128, HAS_IDS=True, USE_PDL=pdl), 4),
        *([] if pdl else [_stack(1, 4, 8192), _stack(4, 8, 16384), _stack(4, 8, 16384, seqs=1, aux=True)]),
        *([] if pdl else [("argmax masked block max", argmax._masked_block_max_kernel,    # never dependent-launched
                           dict(x_ptr="*bf16", mask_ptr="*i32", val_ptr="*fp32", idx_ptr="*i32", cnt_ptr="*i32",
                                stride_x="i32", stride_mask="i32", stride_p="i32", V="i32"), dict(BLOCK_V=1024), 4)]),
        ("spec_ops correct", spec_ops._correct_kernel, correct,
         dict(BLOCK_SIZE=16, DRAFTS=True, HISTORY=True, DRAFTED=True, BLOCK=32, USE_PDL=pdl), 4),
        ("spec_ops draft_layout", spec_ops._draft_layout_kernel, layout,
         dict(K=3, K_PAD=4, BLOCK_SIZE=16, COLS=256, GATHER=False, WIDTH=1, USE_PDL=pdl), 1),
        ("spec_ops draft_layout gather", spec_ops._draft_layout_kernel, layout,
         dict(K=3, K_PAD=4, BLOCK_SIZE=16, COLS=256, GATHER=True, WIDTH=1024, USE_PDL=pdl), 1),
        ("ngram_draft", ngram_draft._ngram_kernel,
         dict(hist_ptr="*i32", stride_hist="i32", rows_ptr="*i64", lengths_ptr="*i64", drafts_ptr="*i64",
              count_ptr="*i64", n_rows="i32", L="i32", k="i32", min_n="i32"),
         dict(MAX_N=3, K_PAD=4, BLOCK=512, USE_PDL=pdl), 4),
        ("tree_finish tree of 8 on a chain of 3", tree_finish._tree_finish_kernel, tree,
         dict(D=3, N=8, W=16, L=5, BLOCK=16, USE_PDL=pdl), 4),
        *([] if pdl else [("tree_finish move_leaves", tree_finish._move_leaves_kernel,     # never dependent-launched
                           dict(slab_ptr="*bf16", move_ptr="*i64", stride_layer="i32"), dict(WIDTH=192, BLOCK=256),
                           4)]),
        ("spec_finish greedy_finish next_ids", spec_finish._greedy_finish_kernel, finish,
         dict(K=3, J=4, W=8, HISTORY=False, NEXT=True, ROWS=True, BLOCK=4, USE_PDL=pdl), 4),
        _attention(1, True, False, pdl), _attention(4, True, True, pdl), _attention(4, False, True, pdl),
        _attention(2, True, True, pdl, tree=True),
        _decode_attention(1, False, pdl), _decode_attention(4, False, pdl), _decode_attention(1, False, pdl, 2),
        ("head_ops embed_pair_norm", head_ops._embed_pair_norm_kernel,
         dict(ids_ptr="*i64", emb_ptr="*bf16", feat_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", stride_ids="i32",
              stride_emb="i32", stride_feat="i32", stride_out="i32", n_cols="i32", vocab="i32", eps="fp32"),
         dict(BLOCK=1024, USE_PDL=pdl), 4),
        ("spec_finish greedy_finish history", spec_finish._greedy_finish_kernel, finish,
         dict(K=3, J=4, W=8, HISTORY=True, NEXT=False, ROWS=False, BLOCK=1, USE_PDL=pdl), 4),
        ("spec_finish greedy_finish plain step", spec_finish._greedy_finish_kernel, finish,
         dict(K=0, J=1, W=8, HISTORY=False, NEXT=True, ROWS=True, BLOCK=32, USE_PDL=pdl), 4),
        ("step_io inputs", step_io._inputs_kernel,
         {p: "*i64" for p in ("in_ptr", "carry_ptr", "tok_row_ptr", "last_ptr", "ids_ptr")} | dict(
             w_ptr="*bf16", x_ptr="*bf16", n_rows="i32", H="i32", stride_w="i32", stride_x="i32"),
         dict(CARRY=True, STORE_IDS=True, BLOCK_H=1024, USE_PDL=pdl), 4),
        ("step_io emit", step_io._emit_kernel,
         {p: "*i64" for p in ("tok_ptr", "sampled_ptr", "rows_ptr", "last_ptr")} | dict(n="i32", n_rows="i32"),
         dict(BLOCK=32, USE_PDL=pdl), 4),
    ]


def _divisibility(kernel, types: dict, values: dict) -> dict:
    """The JIT's specialization of a launch: pointers (torch's allocations) and integers that are multiples of 16
    are marked so. Without it loads of a runtime K are not vectorized and the registers counted are not the GPU's."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
            if types.get(name, "").startswith("*") or values.get(name, 1) % 16 == 0}


def compile_one(kernel, types: dict, consts: dict, warps: int, values: dict | None = None) -> dict:
    """Compile for TARGET -> {registers, local, shared, pdl, mma} (pdl: griddepcontrol in the PTX; mma: which
    tensor-core instruction it holds, if any). values: integer arguments known at the default model's shapes."""
    src = ASTSource(fn=kernel, signature=types | {name: "constexpr" for name in consts}, constexprs=consts,
                    attrs=_divisibility(kernel, types, values or {}))
    compiled = triton.compile(src, target=TARGET, options=dict(num_warps=warps))
    usage, ptx = _resource_usage(compiled.asm["cubin"]), compiled.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else None     # warpgroup MMA: Hopper's
    return dict(usage, shared=compiled.metadata.shared, pdl="griddepcontrol" in ptx, mma=mma)


def _resource_usage(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*?LOCAL:(\d+)", out)
    return dict(registers=int(found[1]), local=int(found[2])) if found else dict(registers=None, local=None)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    failed = 0
    for pdl in (True, False):
        seen = set()
        for label, kernel, types, consts, warps, *values in variants(pdl):
            if not pdl and "USE_PDL" in consts and kernel in seen:
                continue        # USE_PDL off: one variant a kernel (the docstring says why)
            seen.add(kernel)
            try:
                r = compile_one(kernel, types, dict(consts), warps, *values)
            except Exception as e:      # report every variant, then fail
                failed += 1
                print(f"FAIL {label} pdl={pdl}: {type(e).__name__}: {str(e).strip().splitlines()[:1]}")
                continue
            bad = r["pdl"] != pdl
            failed += bad
            print(f"{'FAIL' if bad else 'ok  '} {label} pdl={pdl}: {r['registers']} registers, {r['local']} B local, "
                  f"{r['shared']} B shared, griddepcontrol {r['pdl']}{', ' + r['mma'] if r['mma'] else ''}")
    print(f"triton {triton.__version__}, target sm_{TARGET.arch}: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
