"""Running one model over N processes: rank 0 starts and watches the workers (cluster.py), each worker runs the
same steps on its shard (worker.py), and rank 0 sends every step to them (channel.py). The collectives and the
weight split they use are engine/parallel/."""
