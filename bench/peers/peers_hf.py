"""Hugging Face transformers on our workload: N streams x T new tokens (EOS ignored, greedy), same weights
(the engine's converted checkpoint directory) and the same chat prompts as bench/step/throughput.py.

    python -m bench.peers.peers_hf                              # all modes, 1/8/32 streams, bf16, CUDA
    python -m bench.peers.peers_hf --modes hf_cb_sync hf_cb_async --streams 1 8 32 --new-tokens 128
    python -m bench.peers.peers_hf --device cpu --dtype float32 --streams 1 2 --new-tokens 8 --out /tmp/p.json

Modes (each in its own try/except: a failure is recorded as the record's `error`, the run goes on):
  hf_cb_sync         model.generate_batch(...) with ContinuousBatchingConfig(use_async_batching=False)
  hf_cb_async        the same with use_async_batching=True (double-buffered IO, H2D/compute/D2H streams;
                     transformers requires CUDA or XPU for it)
  hf_static_compile  model.generate(...) on a left-padded batch of N, cache_implementation="static",
                     compile_config=CompileConfig(mode="reduce-overhead"): transformers compiles the decode
                     forward itself (prefill stays eager). It compiles on CUDA only; on CPU this mode runs
                     uncompiled unless --cpu-compile, and the record says compiled=False.
CB runs the model as paged|eager (--cb-attn; paged|sdpa was 2.5x slower on the H100 image, which has no
flash-attn) with a KV cache sized to the workload and 2048 tokens per step (--cb-config overrides any
ContinuousBatchingConfig field; null = transformers' own choice). Static uses --attn (sdpa).
CB warm-up: one generate_batch on other prompts with persistent_manager=True (builds and sizes the
manager, warms up / captures); the timed run reuses that manager through continuous_batching_context_manager
and times add_requests -> last finished result (thread start/stop excluded); the manager is destroyed
after each (mode, streams).
Static warm-up: two generate calls on the same batch (compile, then cudagraph recording).
ms_per_step is wall / new_tokens (one prefill step + new_tokens - 1 decode steps, all streams in each).

From another bench: `from bench.peers.peers_hf import run_peers; records = run_peers([1, 8, 32], 128)`.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from bench.common import chat_prompts, free_gpu_memory, markdown_table, note, plot, progress, record, write_results

MODES = ("hf_cb_sync", "hf_cb_async", "hf_static_compile")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
COLUMNS = ["mode", "streams", "new_tokens", "tok_s", "ms_per_step", "wall_s", "compiled", "error"]


class Skipped(Exception):
    """A mode that cannot run here (recorded as `error`, without a traceback)."""


# ---- model and workload ----------------------------------------------------------------------------
def checkpoint_dir(model_spec=None):
    from engine.models.loader import resolve_model
    src = resolve_model(model_spec)
    if src.path is None:
        raise ValueError(f"{src.name} has no checkpoint directory (dummy weights): transformers needs one")
    return src


def load_model(path, dtype: str, device: str, attn: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], attn_implementation=attn)
    return model.to(device).eval()


def gen_config(new_tokens: int, pad_id: int, **kw):
    """Greedy, exactly new_tokens: eos_token_id=-1 disables EOS (CB: documented; generate: warns, runs on)."""
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=pad_id, **kw)


def left_pad(prompts, pad_id: int, device):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---- transformers continuous batching ---------------------------------------------------------------
def cb_sizing(prompts, new_tokens: int) -> dict:
    """A KV cache sized to the workload (x2 + 16 pages) and our engine's token budget per step (2048).

    transformers' own sizing (num_blocks/max_batch_tokens None: ~90% of free GPU memory) makes its async
    mode pathologically slow: on an H100 with 5.17 it ran at ~2 tok/s vs ~14 with a right-sized cache."""
    from transformers import ContinuousBatchingConfig
    default = ContinuousBatchingConfig()
    page = getattr(default, "page_size", None) or getattr(default, "block_size", None) or 256   # 5.17: block_size
    pages = sum(-(-(len(p) + new_tokens) // page) for p in prompts)
    return dict(num_blocks=2 * pages + 16, max_batch_tokens=2048)


def cb_config(use_async: bool, prompts, new_tokens: int, overrides: dict | None):
    from transformers import ContinuousBatchingConfig
    kw = dict(cb_sizing(prompts, new_tokens), **(overrides or {}))
    return ContinuousBatchingConfig(use_async_batching=use_async, **kw)


def _check(outputs, expected: int) -> int:
    errors = [str(r.error) for r in outputs if getattr(r, "error", None) is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} of {expected} CB requests failed: {errors[0]}")
    if len(outputs) != expected:
        raise RuntimeError(f"CB returned {len(outputs)} of {expected} requests")
    return sum(len(r.generated_tokens) for r in outputs)


def _cb_timed(model, prompts, new_tokens: int):
    """Reuse the cached (warm) manager; time add_requests -> last finished result (not start/stop)."""
    with model.continuous_batching_context_manager(block=True, timeout=5, persistent_manager=True) as mgr:
        t0 = time.perf_counter()
        ids = mgr.add_requests(inputs=prompts, max_new_tokens=new_tokens)
        done = {}
        while len(done) < len(ids):
            r = mgr.get_result(timeout=1)
            if r is not None and r.is_finished():
                done[r.request_id] = r
            elif r is None and not mgr.is_running():
                raise RuntimeError("the continuous batching thread stopped early")
        wall = time.perf_counter() - t0
        attn = model.config._attn_implementation              # the paged one, while the manager runs
    return list(done.values()), wall, attn


def run_cb(model, prompts, warm_prompts, new_tokens, pad_id, use_async, device, attn, overrides) -> dict:
    gcfg = gen_config(new_tokens, pad_id)
    cbcfg = cb_config(use_async, prompts + warm_prompts, new_tokens, overrides)
    model.destroy_cached_continuous_batching_manager()       # never reuse another mode's manager
    previous_attn = model.config._attn_implementation
    model.set_attn_implementation(attn)                       # CB runs it as paged|<attn>
    try:
        warm = model.generate_batch(warm_prompts, generation_config=gcfg, continuous_batching_config=cbcfg,
                                    persistent_manager=True, progress_bar=False)   # build, size, warm up
        _check(list(warm.values()), len(warm_prompts))
        mgr = getattr(model, "_cached_continuous_batching_manager", None)
        if mgr is None:
            raise RuntimeError("generate_batch(persistent_manager=True) left no cached manager")
        resolved = mgr.continuous_batching_config
        _sync(device)
        outputs, wall, used_attn = _cb_timed(model, prompts, new_tokens)
        generated = _check(outputs, len(prompts))
    finally:
        model.destroy_cached_continuous_batching_manager()
        model.set_attn_implementation(previous_attn)
    return dict(generated=generated, wall=wall, compiled=False, attn_implementation=used_attn,
                use_async_batching=resolved.use_async_batching, num_blocks=resolved.num_blocks,
                max_batch_tokens=resolved.max_batch_tokens,
                use_cuda_graph=str(getattr(resolved, "use_cuda_graph", None)))


# ---- static cache + torch.compile ------------------------------------------------------------------
def run_static(model, prompts, new_tokens, pad_id, device, fullgraph=True, cpu_compile=False) -> dict:
    from transformers import CompileConfig
    ccfg = CompileConfig(fullgraph=fullgraph, dynamic=False, mode="reduce-overhead")
    if cpu_compile:
        ccfg._compile_all_devices = True                     # transformers' flag to compile off-GPU (tests)
    torch._dynamo.reset()                                     # fresh static-shape compile for this batch size
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    ids, mask = left_pad(prompts, pad_id, device)
    kw = dict(attention_mask=mask,
              generation_config=gen_config(new_tokens, pad_id, cache_implementation="static", compile_config=ccfg))
    for _ in range(2):                                        # compile, then record the CUDA graphs
        model.generate(ids, **kw)
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    _sync(device)
    wall = time.perf_counter() - t0
    generated = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return dict(generated=generated, wall=wall, compiled=hasattr(model, "_compiled_call"),
                attn_implementation=model.config._attn_implementation)


# ---- sweep -----------------------------------------------------------------------------------------
def run_mode(mode, model, prompts, warm_prompts, new_tokens, pad_id, device, opts) -> dict:
    cb = (model, prompts, warm_prompts, new_tokens, pad_id)
    if mode == "hf_cb_sync":
        return run_cb(*cb, False, device, opts.get("cb_attn", "eager"), opts.get("cb_config"))
    if mode == "hf_cb_async":
        if torch.device(device).type not in ("cuda", "xpu"):
            raise Skipped("transformers' async batching needs CUDA or XPU streams")
        return run_cb(*cb, True, device, opts.get("cb_attn", "eager"), opts.get("cb_config"))
    if mode == "hf_static_compile":
        cpu = torch.device(device).type != "cuda"
        if cpu and not opts.get("cpu_compile"):
            note("hf_static_compile: transformers compiles only on CUDA; running static cache uncompiled "
                 "on CPU (pass --cpu-compile to force torch.compile)")
        return run_static(model, prompts, new_tokens, pad_id, device, opts.get("fullgraph", True),
                          cpu and opts.get("cpu_compile", False))
    raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")


def _record(mode, name, dtype, streams, new_tokens, res=None, error=None, **extra):
    if error is not None:
        return record("peers_hf", mode, name, dtype, streams, new_tokens, None, None, error=error, **extra)
    expected = streams * new_tokens
    err = None if res["generated"] == expected else f"generated {res['generated']} tokens, expected {expected}"
    tok_s = res["generated"] / res["wall"]
    ms = 1e3 * res["wall"] / new_tokens
    fields = {k: v for k, v in res.items() if k not in ("generated", "wall")}
    return record("peers_hf", mode, name, dtype, streams, new_tokens, tok_s, ms, wall_s=res["wall"],
                  generated_tokens=res["generated"], error=err, **fields, **extra)


def run_peers(streams_list=(1, 8, 32), new_tokens=128, modes=MODES, dtype="bfloat16", device=None,
              model_spec=None, attn="sdpa", **opts) -> list[dict]:
    """Run the HF peers; one record per (mode, streams). Never raises for a failing mode."""
    import transformers
    from engine.models.loader import load_tokenizer
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    src = checkpoint_dir(model_spec)
    tok = load_tokenizer(src)
    all_prompts = chat_prompts(tok, 2 * max(streams_list))    # timed: [:n]; CB warm-up: other prompts
    eos = src.config.get("eos_token_id")
    pad_id = src.config.get("pad_token_id") or (eos[0] if isinstance(eos, list) else eos) or 0
    model = load_model(src.path, dtype, device, attn)
    extra = dict(transformers_version=transformers.__version__, torch_version=torch.__version__,
                 prompt_source="bench.common.chat_prompts")
    records = []
    for mode, n in progress([(m, s) for m in modes for s in streams_list], "peers_hf (mode, streams)"):
        prompts, warm = all_prompts[:n], all_prompts[-n:]
        try:
            res = run_mode(mode, model, prompts, warm, new_tokens, pad_id, device, opts)
            rec = _record(mode, src.name, dtype, n, new_tokens, res, **extra)
            note(f"{mode} streams={n}: {rec['tok_s']:,.1f} tok/s" + (f" ({rec['error']})" if rec["error"] else ""))
        except Skipped as e:
            note(f"{mode} streams={n}: skipped: {e}")
            rec = _record(mode, src.name, dtype, n, new_tokens, error=f"skipped on {device}: {e}", **extra)
        except Exception as e:                 # noqa: BLE001 - record it, go on with the next mode
            traceback.print_exc()
            rec = _record(mode, src.name, dtype, n, new_tokens, error=f"{type(e).__name__}: {e}", **extra)
        records.append(rec)
        free_gpu_memory()
    del model
    free_gpu_memory()
    return records


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model spec resolved by engine.models.loader (default model)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument("--attn", default="sdpa", help="attn_implementation for hf_static_compile")
    p.add_argument("--cb-attn", default="eager", help="attn_implementation for CB (run as paged|<it>); eager "
                   "beat sdpa 2.5x on the H100 image (no flash-attn there)")
    p.add_argument("--cb-config", type=json.loads, default=None, metavar="JSON",
                   help='ContinuousBatchingConfig overrides, e.g. \'{"num_blocks": null, "max_batch_tokens": null}\' '
                        "for transformers' own memory-based sizing")
    p.add_argument("--no-fullgraph", action="store_true", help="static compile without fullgraph=True")
    p.add_argument("--cpu-compile", action="store_true", help="force torch.compile on CPU (slow; tests)")
    p.add_argument("--out", default="bench/results/peers_hf.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    records = run_peers(args.streams, args.new_tokens, args.modes, args.dtype, args.device, args.model,
                        args.attn, fullgraph=not args.no_fullgraph, cpu_compile=args.cpu_compile,
                        cb_attn=args.cb_attn, cb_config=args.cb_config)
    write_results(records, args.out)
    plot(records, "streams", "tok_s", "mode", str(args.out).rsplit(".", 1)[0] + ".png",
         f"transformers peers ({records[0]['model']}, {args.dtype}, {args.new_tokens} new tokens)")
    print(markdown_table(records, COLUMNS))
    return records


if __name__ == "__main__":
    main()
