"""Workflow stages, one module per Snakemake rule (prepare_model, shard, policy, generate, merge,
report) plus `tables` (the schemas, statuses and file names they share). Only `generate` (and
`prepare_model`, which builds a checkpoint) import torch or the engine; the light stages stay
torch-free so a rule that moves a few files costs no more than an interpreter start."""
