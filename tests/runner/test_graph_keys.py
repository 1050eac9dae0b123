"""Which CUDA graphs a step takes (engine/runner/graphs.py StepGraphs.keys and key_for), without capturing any: a
speculating engine's spec graphs per level of K, and its quiet decode graphs (no drafting) at the sizes it
speculates at."""
from types import SimpleNamespace

from engine.config import EngineConfig
from engine.runner.graphs import GraphKey, StepGraphs


def _graphs(**cfg) -> StepGraphs:
    config = EngineConfig.of(max_num_seqs=64, max_num_batched_tokens=256, **cfg)
    return StepGraphs(config, 1024, guided=False, spec_rows=16 if config.spec_k else 0)


def _decode_step(rows: int, quiet: bool = False, context: int = 100):
    return SimpleNamespace(spec_k=0, quiet=quiet, num_seqs=rows, num_sample=rows, num_tokens=rows, max_query_len=1,
                           max_seq_len=context)


def test_a_speculating_engine_has_quiet_decode_graphs_where_it_speculates():
    graphs = _graphs(speculative="ngram", num_speculative_tokens=3)
    keys = graphs.keys()
    quiet = {(k.seqs, k.context) for k in keys if not k.drafts}
    assert quiet == {(bs, ctx) for bs in (1, 2, 4, 8, 16) for ctx in (512, 1024)}
    assert all(k.kind == "decode" for k in keys if not k.drafts)
    assert {k.spec_k for k in keys if k.kind == "spec"} == {1, 3}
    assert len(keys) == len(set(keys))
    assert graphs.key_for(_decode_step(5, quiet=True)) == GraphKey("decode", 8, 8, 512, False)
    assert graphs.key_for(_decode_step(5)) == GraphKey("decode", 8, 8, 512, True)
    # past the rows that speculate a step drafts nothing anyway: the one graph of its size
    assert graphs.key_for(_decode_step(40, quiet=True, context=700)) == GraphKey("decode", 40, 40, 1024, True)


def test_an_engine_without_speculation_has_no_quiet_graphs():
    graphs = _graphs()
    assert all(k.drafts for k in graphs.keys())
    assert graphs.key_for(_decode_step(3, quiet=True)).drafts


def test_a_tree_engine_captures_no_extras_graph_of_its_tree():
    """A step with logprobs rows verifies the tree's chain, so the tree's spec graphs exist without extras only (the
    step program refuses a tree step with extras)."""
    graphs = _graphs(speculative="eagle", num_speculative_tokens=3, spec_tree=8, logprobs=True)
    spec = [k for k in graphs.keys() if k.kind == "spec"]
    assert {k.spec_k for k in spec} >= {3, 8}
    extras = [v for v in graphs.variants if v.extras]
    assert extras and len(extras) < len(graphs.variants)
    for key in spec:
        assert all(graphs.captures(key, v) for v in graphs.variants if not v.extras)
        assert all(graphs.captures(key, v) == (key.spec_k != 8) for v in extras), key
    assert all(graphs.captures(k, v) for k in graphs.keys() if k.kind != "spec" for v in graphs.variants)
