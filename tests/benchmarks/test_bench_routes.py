"""bench/step/routes.py's --replay: a recorded tuner run through today's tuner, without a GPU."""
import json

from bench.step import routes


def _cell(kernel, **us):
    return {"kernel": kernel, "us": us}


def test_a_replay_counts_the_timings_the_tuner_takes_now_and_the_choices_that_change():
    cells = {"linear 64 32 2": _cell("stream", gemv=9.0, stream=3.0, cublas=10.0, stream_wide=2.0),
             "linear 64 32 4": _cell("stream", gemv=9.5, stream=3.1, cublas=10.0),
             "norm_linear 96 32 2": _cell("gemm", gemm=4.0, cublas=5.0)}
    got = routes.replay(cells)
    # stream_wide is no candidate of a plain matmul; gemv lost 3x at 2 rows, so 4 rows do not time it
    assert got == dict(cells=3, recorded_timings=8, timings_now=7, changed=[])


def test_the_replay_reads_cache_files_and_records(tmp_path, capsys):
    cells = {"linear 64 32 2": _cell("cublas", gemv=5.0, cublas=4.0)}
    (tmp_path / "cache.json").write_text(json.dumps({"fingerprint": {}, "cells": cells}))
    (tmp_path / "records.json").write_text(json.dumps([{"study": "a", "cells": cells}, {"bench": "other"}]))
    routes.main(["--replay", str(tmp_path / "cache.json"), str(tmp_path / "records.json")])
    table = capsys.readouterr().out
    assert table.count("| 1 | 2 | 2 | [] |") == 2 and "| a |" in table
