"""Training and study of the EAGLE-style draft head: its self-distillation data and training loop (eagle/),
`python -m specdec.train_head`, and the shipped heads (heads/); acceptance-length studies of the drafters
(acceptance/, `python -m specdec.acceptance`) over the prompt sets in datasets.py. It imports the engine; the engine
never imports it (speculation when serving is engine/speculative/, docs/speculative.md; the `specdec acceptance` command
imports the study only when it runs)."""
