"""One step on the device: the model runner (model_runner.py) fills a slot's buffers (slots.py) with the scheduled
rows (rows.py), runs the step's device work (step.py, or spec_step.py with speculation) eagerly or as a CUDA graph
(graphs.py), and brings the tokens back."""
