"""The persistent decode stack: a step's whole layer stack in one launch (stack.py). The package itself loads
nothing, so the route table can read the stack's row bound without importing its kernels."""

MAX_ROWS = 4            # rows a step may hold (the kernel keeps every row's activations in each program)
