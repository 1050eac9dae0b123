"""The persistent decode stack's counters in global memory (engine/kernels/persistent/decode_stack.py): a task
counts itself done (release), and a task of the next stage waits for the count (acquire)."""
import triton
import triton.language as tl


@triton.jit
def _wait(cnt_ptr, index, target):
    """Until counter `index` reaches `target`: polled with plain loads from L2, then one acquire atomic (it reads
    the last count, so it synchronizes with every release before it) and a CTA barrier, so that every thread's
    reads come after it."""
    while tl.load(cnt_ptr + index, volatile=True) < target:
        pass
    tl.atomic_add(cnt_ptr + index, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _signal(cnt_ptr, index):
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + index, 1, sem="release", scope="gpu")
