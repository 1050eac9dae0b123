"""The benchmarks, one package per concept (bench/README.md); each runs as `python -m bench.<group>.<script>`."""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _pythonpath_first() -> None:
    # `PYTHONPATH=<another tree> python -m bench.x` measures that tree's engine with this tree's bench, but `-m` puts
    # the cwd (this repository) first: with `bench` imported here, its entries can go after PYTHONPATH's
    pythonpath = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    if not pythonpath or _ROOT in pythonpath:     # unset, or this repository is on it: its own order stands
        return
    ours = [p for p in sys.path if os.path.realpath(p or os.curdir) == _ROOT]
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != _ROOT]
    last = max((i for i, p in enumerate(rest) if os.path.realpath(p or os.curdir) in pythonpath), default=-1)
    if ours and last >= 0:
        sys.path[:] = rest[:last + 1] + ours + rest[last + 1:]


_pythonpath_first()
