"""The model: spec and architecture tables read from config.json (torch-free: `spec`, `arch`),
safetensors loading, weights, layer math, the paged KV cache and attention (a torch reference
and the Cython kernels). Import the submodule you need; this package imports nothing itself so
the torch-free parts stay cheap to import."""
