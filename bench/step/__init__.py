"""The decode step: throughput, its host and device parts, launches, commits, pipelining and TP."""
