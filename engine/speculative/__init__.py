"""Speculative decoding as the engine serves it (docs/speculative.md): drafters (drafters/), which steps
speculate and their rows' inputs (plan.py), the device-side state (state.py), verification (verify.py), and the
EAGLE-style draft head's model and paged KV (eagle_head.py, eagle_paged.py). The step program that runs them is
the runner's (engine/runner/spec_step.py). Training the head lives in the top-level specdec package, which imports
this one."""
