"""Performance-model accuracy: profile this machine, predict the engine's generation throughput
on the small-mixtral benchmark workload with the policy the search picks, run the engine with
that policy, and compare.

The benchmark workload: `--requests` (48) prompts of token ids with lengths drawn uniformly from
[`--min-prompt`, `--max-prompt`] ([32, 224], mean 128) by a fixed seed, `--gen` (32) new tokens
each, greedy, EOS ignored (every request generates exactly `--gen` tokens).

Profile and engine run in the same process: the machine is profiled before the run and again
after it, and the prediction is the mean of the two (the shared VM's load drifts between runs).

    .venv/bin/python bench/model_accuracy.py [--requests 64] [--gen 32] [--fast-profile] [--cached-profile]
        [--matmul-precision high]   # the storage it holds the weights in is profiled and priced

Last line: RESULT predicted_tok_s=<x> measured_tok_s=<y> accuracy=<1-|x-y|/y>
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def benchmark_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids above the special tokens and within the tokenizer's vocabulary.
    return [[rng.randrange(16, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-mixtral", help="built-in preset (small-mixtral, tiny-mixtral)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=224)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resources", type=Path, default=REPO / "resources")
    ap.add_argument("--fast-profile", action="store_true", help="reduced profiler (fewer shapes timed)")
    ap.add_argument("--cached-profile", action="store_true",
                    help="reuse the machine cache's hardware profile instead of measuring now")
    ap.add_argument("--profile-runs", type=int, default=2, choices=(1, 2),
                    help="profile before the run, or before and after (prediction = their mean)")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads for the profiler and the engine (0 = all cores); on a loaded VM, 1 "
                         "avoids OpenMP barriers waiting on a descheduled thread")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--matmul-precision", default="highest", choices=("highest", "high", "medium"),
                    help="engine.matmul_precision: the model is profiled and priced in the "
                         "storage the engine then holds its weights in, as the policy stage does")
    ap.add_argument("--expert-dtype", default="auto",
                    choices=("auto", "bf16", "fp16", "fp32", "int8", "int4", "mxfp4"),
                    help="engine.expert_dtype (int8 under medium: int8q experts), held and "
                         "priced alike")
    args = ap.parse_args(argv)

    from moe_engine.tools.checkpoints import PRESETS, ensure_builtin
    from moe_engine.config import EngineConfig, ExpertDType, MatmulPrecision
    from moe_engine.stages.policy import held_expert_storage, held_weight_storage
    from moe_engine.engine.llm_engine import LLMEngine
    from moe_engine.perf import ModelSpec, apply_policy, choose_policy, workload_spec_from_lengths
    from moe_engine.io import hardware_cache_dir
    from moe_engine.perf.hardware import cached_profile_path, spec_from_figures
    from moe_engine.tools.profile_hardware import calibrate, ensure_profile, profile_machine, write_profile
    from moe_engine.engine.request import Request, SamplingParams
    from moe_engine.tools import machine_info

    print(machine_info.header(args.threads or os.cpu_count() or 1), flush=True)
    model_dir = ensure_builtin(args.model, args.resources)
    model = ModelSpec.from_hf_config(model_dir, name=args.model)
    base_cfg = EngineConfig(threads=args.threads,
                            matmul_precision=MatmulPrecision(args.matmul_precision),
                            expert_dtype=ExpertDType(args.expert_dtype))
    model = (model.with_expert_storage(held_expert_storage(base_cfg, model.expert_storage,
                                                           model.torch_dtype))
             .with_weight_storage(held_weight_storage(base_cfg, model.torch_dtype)))

    vocab = PRESETS[args.model].tokenizer_vocab_size
    prompts = benchmark_prompts(args.requests, args.min_prompt, args.max_prompt, vocab, args.seed)
    wl = workload_spec_from_lengths([len(p) for p in prompts], args.gen)
    cache = cached_profile_path(hardware_cache_dir())

    def measure_and_predict(label: str):
        t0 = time.perf_counter()
        # Both with the engine's in-run factors measured on the checkpoint, as the policy
        # stage's profile has them.
        if args.cached_profile:
            profile = ensure_profile(cache, model=model, fast=args.fast_profile, checkpoint=model_dir)
        else:
            profile = profile_machine([model], fast=args.fast_profile, threads=args.threads)
            calibrate(profile, [(model, model_dir)], args.fast_profile, args.threads)
            if not args.threads:
                write_profile(profile, cache)
        result = choose_policy(model, spec_from_figures(profile, model.weight_storage), wl,
                               backend="cpu")
        print(f"profile {label}: {time.perf_counter() - t0:.1f} s; read {profile['cpu_bw_gbps']} GB/s, GEMM peak "
              f"{profile['device_tflops'] * 1e3:.0f} GFLOP/s, attention {profile['cpu_attention_gbps']} GB/s "
              f"({profile['attention_kernel']}), op overhead {profile['op_overhead_us']} us -> predicted "
              f"{result.throughput_tok_s:.2f} tok/s")
        return result

    result = measure_and_predict("before")
    pj = result.to_json()
    engine_cfg = apply_policy(base_cfg, result)
    pol = pj["policy"]
    print(f"policy: N={pol['batch_size']} mu={pol['micro_batch_size']} micro-batches={pol['num_micro_batches']} "
          f"kv={engine_cfg.kv_cache_gb} GB prefill_tokens={pol['prefill_tokens']}; search {pj['search']['seconds']:.3f} s; "
          f"bottleneck {pj['bottleneck']}; predicted prefill {pj['prediction']['prefill_s']:.2f} s + decode "
          f"{pj['prediction']['decode_s']:.2f} s")

    engine = LLMEngine(model_dir, engine_cfg, dtype="auto")
    sampling = SamplingParams(max_new_tokens=args.gen, temperature=0.0, ignore_eos=True)
    # Warm-up: first calls of each kernel pay one-off allocation and dispatch costs.
    list(engine.generate([Request(f"warm{i}", prompt_token_ids=prompts[i][:32],
                                  sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
                          for i in range(min(4, len(prompts)))]))
    requests = [Request(f"r{i}", prompt_token_ids=p, sampling=sampling) for i, p in enumerate(prompts)]
    t1 = time.perf_counter()
    results = list(engine.generate(requests))
    wall = time.perf_counter() - t1
    stats = engine.stats.to_dict()
    bad = [r for r in results if r.status != "ok"]
    if bad:
        print(f"warning: {len(bad)} requests did not complete: {bad[0].error}")
    generated = sum(r.completion_tokens for r in results)
    measured = generated / wall
    predictions = [result.throughput_tok_s]
    if args.profile_runs > 1:
        # The VM's load drifts; the machine measured on both sides of the run brackets it.
        after = measure_and_predict("after")
        if after.policy == result.policy:
            predictions.append(after.throughput_tok_s)
        else:
            from moe_engine.perf import predict

            predictions.append(predict(model, after.hardware, wl, result.policy, True).throughput_tok_s)
    predicted = sum(predictions) / len(predictions)
    accuracy = 1.0 - abs(predicted - measured) / measured
    print(f"engine: {generated} tokens in {wall:.2f} s; prefill {stats['prefill_time_s']:.2f} s, decode "
          f"{stats['decode_time_s']:.2f} s; attention {stats['attention_time_s']:.2f} s, ffn {stats['ffn_time_s']:.2f} s, "
          f"dense {stats['dense_time_s']:.2f} s, head {stats['head_time_s']:.2f} s, sampling "
          f"{stats['sampling_time_s']:.2f} s, schedule {stats['schedule_time_s']:.2f} s; steps {stats['steps']}, "
          f"preemptions {stats['preemptions']}")
    print(f"predicted {predicted:.2f} tok/s, measured {measured:.2f} tok/s, stage-1 bound "
          f"{pj['stage1']['t_max_gen_tok_s']:.2f} tok/s")
    if args.json:
        args.json.write_text(json.dumps({"predicted_tok_s": predicted, "predictions": predictions,
                                         "measured_tok_s": measured,
                                         "accuracy": accuracy, "policy": pj, "engine_stats": stats}, indent=1))
    print(f"RESULT predicted_tok_s={predicted:.2f} measured_tok_s={measured:.2f} accuracy={accuracy:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
