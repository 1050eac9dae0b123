"""The speculative step's bookkeeping: correction, draft layout, the greedy finish, the EAGLE head's input."""
