"""The Triton backend's greedy LM head: a step's tokens without float32 logits, on the kernel the route table
names for the head's (op, V, K, rows) (engine/kernels/routes.py):

- "gemv": draft_gemv's argmax epilogue on the decode GEMV (with the final norm as its prologue for "norm_head",
  an EAGLE draft step's);
- "mma": head_mma's argmax on tensor cores (after the norm's kernel for "norm_head");
- "cublas": cuBLAS's logits and engine/kernels/sampling/argmax.py's two kernels, without the logits' float32 copy.

The reference table has no head kernel: the step computes its logits and samples from them, as the torch
backend does.
"""
from __future__ import annotations

from engine.kernels.matmul.cpu_gemm import linear

HEAD_OPS = ("head", "norm_head")


class HeadArgmax:
    """TritonAttention's norm_linear_argmax / linear_argmax (the backend contract's, engine/attention.py). Reads
    the backend's routes, kernel_for, _draft, _mma, _argmax and ops."""

    def norm_linear_argmax(self, x, norm_weight, eps, weight, ids=None):
        if self.routes.reference:
            return None
        kernel = self.kernel_for("norm_head", x, weight, norm_weight=norm_weight)
        if kernel == "gemv":
            return self._draft.norm_linear_argmax(x, norm_weight, eps, weight, ids)
        return self._argmax_on(kernel, self.ops.rms_norm(x, norm_weight, eps), weight, ids)

    def linear_argmax(self, x, weight, ids=None):
        if self.routes.reference:
            return None
        kernel = self.kernel_for("head", x, weight)
        if kernel == "gemv":
            return self._draft.linear_argmax(x, weight, ids)
        return self._argmax_on(kernel, x, weight, ids)

    def _argmax_on(self, kernel: str, x, weight, ids=None):
        """The argmax of x @ weight.T on head_mma (kernel "mma", where it takes x) or cuBLAS's logits."""
        if kernel == "mma" and self._mma.supports(x, weight):
            return self._mma.linear_argmax(x, weight, ids)
        logits = linear(x, weight)
        if self._argmax.supports(logits):
            return self._argmax.argmax_rows(logits, ids)
        rows = logits.float().argmax(-1)
        return rows if ids is None else ids[rows]
