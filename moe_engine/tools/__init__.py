"""Tools run outside the workflow's hot path: the hardware profiler (measures this machine for
the performance model; may import anything), built-in checkpoints and their tokenizer."""
