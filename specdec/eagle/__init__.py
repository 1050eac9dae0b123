"""EAGLE-3-style one-model draft head: weights and dense forward (head.py), training data (data.py), training
loop (train.py). `python -m specdec.train_head` drives them."""
