"""The "silu_mul" epilogue of the decode matmuls (decode_gemv.py, decode_gemm.py): a program of gate_up = [gate; up]
takes gate rows with the up rows of the same columns, so it stores silu(gate) * up, the down projection's input,
and not gate_up (twice the values, read again by down's SiLU prologue)."""
import triton
import triton.language as tl

from engine.kernels.common import round_to


@triton.jit
def block_rows(pid, N, BLOCK_N: tl.constexpr, EPILOGUE: tl.constexpr):
    """Program pid's weight rows and their mask. With the "silu_mul" epilogue (weight = [gate; up], N rows each)
    block row j is the gate row (j even) or the up row (j odd) of act column pid * BLOCK_N / 2 + j // 2."""
    offs_j = tl.arange(0, BLOCK_N)
    if EPILOGUE == "silu_mul":
        offs_a = pid * (BLOCK_N // 2) + offs_j // 2
        offs_n, n_ok = offs_a + (offs_j % 2) * N, offs_a < N
    else:
        offs_n = pid * BLOCK_N + offs_j
        n_ok = offs_n < N
    return offs_n, n_ok


@triton.jit
def silu_store(out_ptr, y, rows, rows_ok, stride_out, N, pid, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[rows, pid * BLOCK_N / 2 + h] = silu(gate) * up of the block's pairs (y [R, BLOCK_N], rounded to the
    dtype: gate, up, gate, up, ...), in fp32 rounded once, as fused_ops.silu_mul on the gate_up they round to."""
    H: tl.constexpr = BLOCK_N // 2
    g, u = tl.split(tl.reshape(y.to(tl.float32), (R, H, 2)))
    act = round_to(g / (1.0 + tl.exp(-g)) * u, out_ptr.dtype.element_ty)
    offs_h = pid * H + tl.arange(0, H)
    mask = rows_ok[:, None] & (offs_h < N)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + offs_h[None, :], act, mask=mask)


def pairs_fit(weight) -> bool:
    """Whether a weight can be [gate; up] for this epilogue: 2-D with an even N (gate's rows, then up's)."""
    return weight.dim() == 2 and weight.shape[0] % 2 == 0


def out_columns(n: int, block_n: int, epilogue: str) -> tuple[int, int]:
    """(output columns, programs) of a launch over n weight rows, BLOCK_N a program: with "silu_mul" a program's
    rows give BLOCK_N / 2 outputs."""
    if epilogue == "silu_mul":
        return n // 2, triton.cdiv(n // 2, block_n // 2)
    return n, triton.cdiv(n, block_n)
