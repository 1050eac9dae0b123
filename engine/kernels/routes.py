"""Which kernel runs each matmul and LM head: a table keyed by (op, N, K, rows), measured, not written by hand.

An op is a matmul with what the engine folds around it:
- "linear": x @ W.T (o_proj; down_proj on the MLP's activation; the EAGLE head's fc and qkv)
- "norm_linear": rms_norm(x + residual) @ W.T (qkv_proj)
- "norm_linear_silu": silu(gate) * up of rms_norm(x + residual) @ [gate; up].T (gate_up_proj)
- "head": argmax(x @ W.T), a greedy step's tokens without float32 logits (the target's LM head)
- "norm_head": argmax(rms_norm(x) @ W.T) (an EAGLE draft step's head, the final norm folded in)
- "stack": a step's whole layer stack, keyed by (hidden, intermediate) size and the step's tokens: "layers" runs it
  layer by layer on the routes above, "persistent" in one launch (engine/kernels/persistent/, up to 4 tokens)

Kernels: "gemv" (engine/kernels/matmul/decode_gemv.py, with draft_gemv.py's argmax for heads), "gemm"
(decode_gemm.py), "stream" (stream_gemm.py: 2-64 rows over large weights, the norm and SiLU * up folded in;
"stream_wide", "stream_narrow" and "stream_split" are its other launch shapes, stream_gemm.config), "mma"
(head_mma.py, heads only) and "cublas" (torch's matmul, the op around it as kernels of its own, and for heads
engine/kernels/sampling/argmax.py). cuBLAS runs everything, so it is every matmul cell's fallback; "layers" is the
stack's.

The table holds the rows the engine captures (engine/kernels/tune.py measures them); a step of other rows takes
the cell of the next larger rows, and past the table's last rows cuBLAS. Pins from a route file override it:

    {"pins": [{"op": "linear", "n": 2048, "k": 8192, "rows": [1, 4], "kernel": "cublas"},
              {"kernel": "gemv", "rows": 1}]}

A pin's op, n, k and rows may be left out (any); rows is one count or an inclusive [lo, hi]; a later pin wins.
pins() writes such a file's JSON in code (tests, benches).
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

OPS = ("linear", "norm_linear", "norm_linear_silu", "head", "norm_head", "stack")
STREAM_KERNELS = {"stream": "base", "stream_wide": "wide", "stream_narrow": "narrow",       # -> stream_gemm variant
                  "stream_split": "split"}
MATMUL_KERNELS = ("gemv", "gemm", *STREAM_KERNELS, "cublas")
HEAD_KERNELS = ("gemv", "mma", "cublas")
STACK_KERNELS = ("persistent", "layers")
KERNELS = ("gemv", "gemm", *STREAM_KERNELS, "mma", "cublas", "persistent", "layers")
MODES = ("auto", "reference")


def kernels_for(op: str) -> tuple[str, ...]:
    """The kernels that can run an op at all (each still checks the call's shapes). stream's narrow launch is for
    ops without a prologue and its wide one for those with the norm: narrow programs would each repeat the norm
    over x, and a plain matmul's few wide programs leave SMs idle."""
    if op in ("head", "norm_head"):
        return HEAD_KERNELS
    if op == "stack":
        return STACK_KERNELS
    unfit = "stream_wide" if op == "linear" else "stream_narrow"
    return tuple(kernel for kernel in MATMUL_KERNELS if kernel != unfit)


def fallback(op: str) -> str:
    """What runs an op no cell or pin routes: cuBLAS, or for the stack its layers."""
    return "layers" if op == "stack" else "cublas"


@dataclass
class Site:
    """A matmul of a model: its op, one weight [N, K] a layer (all of one shape), and for a norm op the norm's
    weight [K] (one layer's: it scales the input, not the cost)."""
    op: str
    weights: list = field(repr=False)
    norm_weight: object = field(default=None, repr=False)

    @property
    def key(self) -> tuple[str, int, int]:
        n, k = self.weights[0].shape
        return self.op, n, k


@dataclass(frozen=True)
class Pin:
    """A route file's entry: `kernel` for every cell it matches (None: any)."""
    kernel: str
    op: str | None = None
    n: int | None = None
    k: int | None = None
    rows: tuple[int, int] | None = None

    def matches(self, op: str, n: int, k: int, rows: int) -> bool:
        return ((self.op is None or self.op == op) and (self.n is None or self.n == n)
                and (self.k is None or self.k == k)
                and (self.rows is None or self.rows[0] <= rows <= self.rows[1]))

    def __str__(self) -> str:
        fields = {f: getattr(self, f) for f in ("op", "n", "k", "rows") if getattr(self, f) is not None}
        return f"pin {fields or 'of every cell'} -> {self.kernel!r}"


def parse_pins(data) -> tuple[Pin, ...]:
    """Pins from a route file's parsed JSON; ValueError naming the entry that is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("pins"), list):
        raise ValueError('a route file holds {"pins": [{"kernel": ..., "op": ..., "n": ..., "k": ..., "rows": ...}]}')
    return tuple(_pin(i, entry) for i, entry in enumerate(data["pins"]))


def _pin(i: int, entry) -> Pin:
    where = f"route file pin {i}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object, got {entry!r}")
    unknown = set(entry) - {"kernel", "op", "n", "k", "rows"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    kernel, op = entry.get("kernel"), entry.get("op")
    if kernel not in KERNELS:
        raise ValueError(f"{where}: unknown kernel {kernel!r}; choose from {KERNELS}")
    if op is not None and op not in OPS:
        raise ValueError(f"{where}: unknown op {op!r}; choose from {OPS}")
    if op is not None and kernel not in kernels_for(op):
        raise ValueError(f"{where}: kernel {kernel!r} cannot run {op!r} (it runs {kernels_for(op)})")
    if op is None and kernel in ("gemm", *STREAM_KERNELS, "mma", "persistent", "layers"):
        raise ValueError(f"{where}: kernel {kernel!r} runs only some ops: name the op")
    for name in ("n", "k"):
        if name in entry and not (isinstance(entry[name], int) and entry[name] > 0):
            raise ValueError(f"{where}: {name} must be a positive integer, got {entry[name]!r}")
    rows = entry.get("rows")
    if rows is not None:
        rows = (rows, rows) if isinstance(rows, int) else tuple(rows) if isinstance(rows, list) else None
        if rows is None or len(rows) != 2 or not all(isinstance(r, int) and r > 0 for r in rows) or rows[0] > rows[1]:
            raise ValueError(f"{where}: rows must be a positive count or [lo, hi], got {entry['rows']!r}")
    return Pin(kernel, op, entry.get("n"), entry.get("k"), rows)


def load_pins(path: str) -> tuple[Pin, ...]:
    """The pins of a route file (EngineConfig.kernel_routes: a path, or the JSON itself where it starts with
    "{"); ValueError naming the file's problem."""
    try:
        data = json.loads(path if path.lstrip().startswith("{") else Path(path).read_text())
    except OSError as e:
        raise ValueError(f"route file {path!r} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"route file {path[:80]!r} is not JSON: {e}") from None
    try:
        return parse_pins(data)
    except ValueError as e:
        raise ValueError(f"{path[:80]}: {e}") from None


def pins(*entries: dict) -> str:
    """A route file's JSON from its pins' fields, e.g. pins(dict(kernel="gemv", rows=[1, 8]))."""
    text = json.dumps({"pins": list(entries)})
    parse_pins(json.loads(text))
    return text


class RouteTable:
    """cells: {(op, n, k): {rows: kernel}}; lookup() of a step's rows reads the cell of the next larger rows.
    reference: cuBLAS for every matmul, no head kernel (the step computes logits and samples from them), and the
    stack layer by layer."""

    def __init__(self, cells: dict | None = None, pins: tuple[Pin, ...] = (), reference: bool = False):
        self.reference = reference
        self.pins = tuple(pins)
        self._rows = {site: sorted(by_rows) for site, by_rows in (cells or {}).items()}
        self._cells = {site: dict(by_rows) for site, by_rows in (cells or {}).items()}

    @classmethod
    def pinned(cls, *pins: Pin) -> RouteTable:
        """Only pins (tests, experiments): cuBLAS wherever none matches."""
        return cls(pins=pins)

    def lookup(self, op: str, n: int, k: int, rows: int) -> str:
        if self.reference:
            return fallback(op)
        for pin in reversed(self.pins):
            if pin.matches(op, n, k, rows) and pin.kernel in kernels_for(op):    # (a pin of any op names its kind)
                return pin.kernel
        tuned = self._rows.get((op, n, k))
        if not tuned:
            return fallback(op)
        i = bisect.bisect_left(tuned, rows)
        return self._cells[(op, n, k)][tuned[i]] if i < len(tuned) else fallback(op)

    def cells(self) -> dict:
        """{(op, n, k): {rows: kernel}} with the pins applied to the measured cells."""
        return {site: {r: self.lookup(*site, r) for r in rows} for site, rows in self._rows.items()}

    def summary(self) -> str:
        """One line a site: its kernel by rows, e.g. 'norm_linear 960x576: gemv 1-2, gemm 4-32'."""
        if self.reference:
            return "reference: cuBLAS for every matmul and head"
        lines = []
        for (op, n, k), by_rows in sorted(self.cells().items()):
            runs, start = [], None
            items = sorted(by_rows.items())
            for i, (r, kernel) in enumerate(items):
                start = r if start is None else start
                if i + 1 == len(items) or items[i + 1][1] != kernel:
                    runs.append(f"{kernel} {start}" + (f"-{r}" if r != start else ""))
                    start = None
            lines.append(f"{op} {n}x{k}: " + ", ".join(runs))
        return "\n".join(lines)
