"""The Triton backend's greedy LM head: which kernels give a step's tokens without float32 logits.

- draft_gemv's argmax epilogue on the decode GEMV (with the final norm as its prologue for an EAGLE draft), for
  steps of up to decode_gemv_rows rows where the caller allows the GEMV (`gemv`: EngineConfig.head_gemv's plain
  steps, verify_gemv's verifications);
- head_mma's argmax on tensor cores (EngineConfig.head_mma) for the others up to its MAX_ROWS, and with
  head_mma_from = N for every head of N rows or more, the GEMV's rows included (an EAGLE draft's after the final
  norm's kernel); none past head_mma_to rows;
- else cuBLAS's logits (the reference path's) and engine/kernels/sampling/argmax.py's two kernels, without the
  logits' float32 copy.
"""
from __future__ import annotations

from engine.kernels.matmul.cpu_gemm import linear


class HeadArgmax:
    """TritonAttention's norm_linear_argmax / linear_argmax (the backend contract's, engine/attention.py). Reads
    the backend's _draft, _gemv_rows, _head_mma, _head_mma_from, _head_mma_to, _argmax and ops."""

    def norm_linear_argmax(self, x, norm_weight, eps, weight, gemv: bool = True, ids=None):
        if self._on_gemv(x, weight, gemv) and self._draft.supports(x, norm_weight, weight):
            return self._draft.norm_linear_argmax(x, norm_weight, eps, weight, ids)
        return self._off_gemv(self.ops.rms_norm(x, norm_weight, eps), weight, ids)

    def linear_argmax(self, x, weight, gemv: bool = True, ids=None):
        if self._on_gemv(x, weight, gemv) and self._draft.supports_linear(x, weight):
            return self._draft.linear_argmax(x, weight, ids)
        return self._off_gemv(x, weight, ids)

    def _on_gemv(self, x, weight, gemv: bool) -> bool:
        """Whether the GEMV may take this head: the caller allows it, draft_gemv is on, the rows are the GEMV's,
        and head_mma_from does not give them to head_mma."""
        rows = x.shape[0]
        return gemv and self._draft is not None and rows <= self._gemv_rows and not (
            rows >= self._head_mma_from and self._mma_takes(x, weight))

    def _mma_takes(self, x, weight) -> bool:
        return self._head_mma is not None and x.shape[0] <= self._head_mma_to and self._head_mma.supports(x, weight)

    def _off_gemv(self, x, weight, ids=None):
        if self._mma_takes(x, weight):
            return self._head_mma.linear_argmax(x, weight, ids)
        logits = linear(x, weight)
        if self._argmax.supports(logits):
            return self._argmax.argmax_rows(logits, ids)
        rows = logits.float().argmax(-1)
        return rows if ids is None else ids[rows]
