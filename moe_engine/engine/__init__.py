"""The engine core: LLMEngine's loop, the scheduler (+ Alg. 2 micro-batching), the KV block
manager, sequences, requests, sampling, the tokenizer, stats and the model runner. Calibration
runs that record routing profiles live in `calibrate`, outside the engine."""
