"""bench/peers/peers_vllm.py on the CPU: the dry run imports no engine, the cross-checks, and the whole driver with a
stand-in for vLLM's offline API (our engine underneath) so that both side processes, the merge and the outputs
run here; vLLM itself runs only on the GPU machine (docs/peers.md)."""
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.peers import peers_vllm as pv
from bench.peers import vllm_report

REPO = Path(__file__).resolve().parents[2]

FAKE_VLLM = '''
"""Stand-in for vLLM's offline API: the calls bench/peers/sides.py makes, answered by our engine."""
__version__ = "0.0.fake"


class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos, structured_outputs=None):
        self.max_tokens, self.ignore_eos, self.so = max_tokens, ignore_eos, structured_outputs


class LLM:
    def __init__(self, model, tokenizer, dtype, seed, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization,
                 enforce_eager, enable_prefix_caching, structured_outputs_config):
        from engine.llm_engine import LLMEngine
        assert structured_outputs_config == dict(backend="xgrammar", disable_any_whitespace=True)
        assert tokenizer == model and not enable_prefix_caching
        self.eng = LLMEngine(model=model, dtype=dtype, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager)

    def generate(self, prompts, params, use_tqdm=True):
        from types import SimpleNamespace as NS
        from engine.requests.sequence import SamplingParams as SP
        sp = [SP(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=p.ignore_eos,
                 json_schema=p.so.json if p.so else None) for p in params]
        seqs = self.eng.generate([p["prompt_token_ids"] for p in prompts], sp)
        return [NS(outputs=[NS(token_ids=s.output_token_ids, finish_reason=s.finish_reason)]) for s in seqs]
'''


def test_dry_run_imports_no_engine():
    code = ("import sys; from bench.peers import peers_vllm as pv; "
            "pv.main(['--dry-run', '--vllm-site', '/nonexistent']); "
            "heavy = [m for m in ('torch', 'vllm', 'engine') if m in sys.modules]; assert not heavy, heavy")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "side vllm" in r.stdout and "PYTHONPATH='/nonexistent'" in r.stdout and "does not exist" in r.stdout


def test_cross_check():
    plan = dict(streams=[2], new_tokens=4, eos_ids=[3])
    rows = [dict(side=s, mode=m, streams=2, tok_s=t) for s, t in (("specdec", 30.0), ("vllm", 20.0))
            for m in ("decode", "guided", "free")]
    outputs = {"specdec": {"decode": {"2": [[1, 2, 3, 4], [5, 6, 7, 8]]}, "guided": {"2": [[1], [2, 3]]}},   # 3: EOS
               "vllm": {"decode": {"2": [[1, 2, 9, 9], [5, 6, 7, 8]]}, "guided": {"2": [[1], [4]]}}}
    pv.cross_check(rows, outputs, plan)
    by = {(r["side"], r["mode"]): r for r in rows}
    assert by["specdec", "decode"]["same_tokens"] == by["vllm", "decode"]["same_tokens"] == (2 + 4) / 8
    assert by["vllm", "guided"]["same_text"] == 0.5 and "same_text" not in by["specdec", "free"]
    assert by["specdec", "free"]["over_vllm"] == 1.5 and "over_vllm" not in by["vllm", "decode"]
    assert vllm_report.shared_prefix([1, 2], [1, 2, 3]) == 2 and vllm_report.shared_prefix([], [1]) == 0


def test_run_side_ends_a_side_slow_to_exit_and_one_past_its_timeout(tmp_path, monkeypatch):
    worker = tmp_path / "worker.py"
    worker.write_text("import json, subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      "open(sys.argv[3], 'w').write(str(child.pid))\n"
                      "if 'exit' in sys.argv[1]:\n"
                      "    open(sys.argv[2], 'w').write(json.dumps({'records': [1], 'outputs': {}}))\n"
                      "time.sleep(60)\n")
    monkeypatch.setattr(pv, "WORKER", (str(worker),))
    monkeypatch.setattr(pv, "EXIT_GRACE", 1)
    plan = dict(streams=[1], parts=["decode"])
    for side, timeout in (("exit", 30), ("hang", 2)):
        pidfile = tmp_path / f"{side}.pid"
        monkeypatch.setattr(pv.subprocess, "Popen", _with_pidfile(pv.subprocess.Popen, pidfile))
        res = pv.run_side(side, plan, SimpleNamespace(side_timeout=timeout, vllm_site=""), tmp_path)
        assert res["records"] == ([1] if side == "exit" else [])
        assert side == "exit" or "without a result" in res["error"]
        assert _gone(int(pidfile.read_text()))          # its child (vLLM's engine core) went with it


def _with_pidfile(popen, pidfile):
    def start(cmd, **kw):
        return popen([*cmd, str(pidfile)], **kw)
    return start


def _gone(pid: int) -> bool:
    """Ended within 5 s (a zombie waiting for init to reap it counts as ended)."""
    for _ in range(50):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_driver_with_a_stand_in_vllm(tmp_path):
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (tmp_path / "site" / "vllm" / "sampling_params.py").write_text(
        "class StructuredOutputsParams:\n    def __init__(self, json):\n        self.json = json\n")
    schemas = tmp_path / "data" / "maskbench"
    schemas.mkdir(parents=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    (schemas / "JME_1.json").write_text(json.dumps({"schema": schema, "tests": []}))
    out = tmp_path / "out" / "pv.json"
    args = ["--dtype", "float32", "--streams", "2", "--new-tokens", "3", "--guided-tokens", "12", "--repeats", "1",
            "--data", str(tmp_path / "data"), "--vllm-site", str(tmp_path / "site"), "--out", str(out),
            "--parts", "decode", "guided"]           # the n-gram part builds two more engines per side
    for sides in (["specdec"], ["vllm", "--merge"]):          # one side per command, as on the GPU machine
        r = subprocess.run([sys.executable, "-m", "bench.peers.peers_vllm", *args, "--sides", *sides], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = json.loads(out.read_text())
    assert sorted((x["side"], x["mode"]) for x in records) == sorted(
        (s, m) for s in ("specdec", "vllm") for m in ("decode", "guided", "free", "jme"))
    assert not [x["error"] for x in records if x.get("error")]
    by = {(x["side"], x["mode"]): x for x in records}
    assert all(by[s, "decode"]["generated_tokens"] == 6 and by[s, "decode"]["same_tokens"] == 1.0 for s in pv.SIDES)
    assert by["specdec", "guided"]["same_text"] == 1.0 and by["specdec", "decode"]["over_vllm"] > 0
    assert by["vllm", "decode"]["command"].endswith("--sides vllm --merge")    # the driver's command line
    assert out.with_suffix(".md").read_text().count("| decode |") == 2
    assert out.with_suffix(".png").exists() or "matplotlib is not installed" in r.stdout + r.stderr
