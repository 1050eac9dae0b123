"""Acceptance-length studies of the speculative drafters: `python -m specdec.acceptance` (or `specdec
acceptance`), documented in docs/acceptance.md. `run_study(Study(...))` returns the records; bench/spec/spec.py's
acceptance part calls it."""
from specdec.acceptance.cli import main
from specdec.acceptance.study import Method, Study, run_study

__all__ = ["Method", "Study", "main", "run_study"]
