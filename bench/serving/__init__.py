"""Serving: `specdec serve` under load against peers, the load client, the servers, soak and agents."""
