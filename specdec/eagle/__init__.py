"""Training the EAGLE-3-style draft head (its model: engine/speculative/eagle_head.py): training data (data.py),
training loop (train.py). `python -m specdec.train_head` drives them."""
