"""Command-line entry points; each workflow rule calls exactly one subcommand.

Every subcommand takes the resolved config written by the Snakefile (`--config`), so a rule's
behaviour is a function of that file and its inputs alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from moe_engine.cache import hardware_cache_dir
from moe_engine.config import AppConfig, ConfigError, load_resolved


def model_dir_of(cfg: AppConfig) -> Path:
    """Where the checkpoint lives: resources/models/<preset> for built-ins, else model.path."""
    if cfg.model.builtin is not None:
        return Path(cfg.resources_dir) / "models" / cfg.model.builtin
    return Path(cfg.model.path)


def _prepare_model(args: argparse.Namespace) -> None:
    from moe_engine.checkpoints import build_checkpoint

    cfg = load_resolved(args.config)
    if cfg.model.builtin is None:
        raise ConfigError("model.builtin=None: prepare-model only builds built-in presets")
    path = build_checkpoint(cfg.model.builtin, args.out, seed=cfg.model.seed,
                            num_shards=cfg.model.num_shards)
    print(f"built {cfg.model.builtin} (seed {cfg.model.seed}) at {path}")


def _shard(args: argparse.Namespace) -> None:
    from moe_engine.corpus import read_corpus
    from moe_engine.sharding import tokenize_frame, write_shards
    from moe_engine.tokenization import load_tokenizer

    cfg = load_resolved(args.config)
    frame = read_corpus(cfg.workload)
    frame = tokenize_frame(frame, load_tokenizer(args.model), cfg.workload.max_prompt_tokens)
    manifest = write_shards(frame, cfg.workload.num_shards, args.out_dir)
    print(f"{manifest.num_rows} rows -> {manifest.num_shards} shards {manifest.shard_rows} "
          f"(prompt tokens {manifest.shard_tokens}), {manifest.rejected_rows} rejected")


def _policy(args: argparse.Namespace) -> None:
    import polars as pl

    from moe_engine.corpus import STATUS_PENDING

    cfg = load_resolved(args.config)
    # Each generate job runs one shard on its own, so the policy is chosen for a shard: the
    # largest one (its batch bound and memory need are the highest), with every row's own
    # prompt and generation length (rejected rows generate nothing).
    frames = [pl.read_parquet(p).filter(pl.col("status") == STATUS_PENDING) for p in args.shards]
    frame = max(frames, key=lambda f: f.height, default=None)
    if frame is not None and frame.height:
        lengths = frame["prompt_tokens"].to_list()
        gen_len = frame["max_new_tokens"].to_list()
    else:
        lengths, gen_len = [1], cfg.workload.max_new_tokens
    engine_knobs = {k: (v.value if hasattr(v, "value") else v) for k, v in cfg.engine.__dict__.items()}
    if cfg.engine.policy.value == "config":
        out = {"source": "config", "engine": engine_knobs}
    else:
        from moe_engine import perf

        model = perf.ModelSpec.from_hf_config(args.model / "config.json")
        hw = perf.hardware_spec_from_config(cfg.hardware, hardware_cache_dir(), model=model)
        wl = perf.workload_spec_from_lengths(lengths, gen_len)
        result = perf.choose_policy(model, hw, wl, backend=cfg.engine.backend.value)
        chosen = perf.apply_policy(cfg.engine, result)
        out = {"source": "search", **result.to_json(),
               "engine": {k: (v.value if hasattr(v, "value") else v) for k, v in chosen.__dict__.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps(out.get("engine"), default=str))


def _generate(args: argparse.Namespace) -> None:
    from moe_engine.shard_runner import run_shard

    cfg = load_resolved(args.config)
    if args.threads:
        cfg = replace(cfg, engine=replace(cfg.engine, threads=args.threads))
    policy = json.loads(args.policy.read_text()) if args.policy else None
    if policy is not None and args.threads and "engine" in policy:
        policy["engine"]["threads"] = args.threads
    stats = run_shard(cfg, args.model, args.shard, args.out, args.stats, policy=policy)
    print(json.dumps({k: stats[k] for k in ("shard", "rows", "resumed_rows", "generated_rows",
                                             "completion_tokens", "wall_time_s")}))


def _merge(args: argparse.Namespace) -> None:
    from moe_engine.merge import merge_generations, write_openai_batch_output

    cfg = load_resolved(args.config)
    merged = merge_generations(args.shard_dir, args.generations, args.out)
    if args.openai_out is not None:
        write_openai_batch_output(merged, cfg.model.name, args.openai_out)
    print(f"merged {merged.height} rows into {args.out}")


def _report(args: argparse.Namespace) -> None:
    from moe_engine.report import write_report

    summary = write_report(args.generations, args.stats, args.policy, args.md, args.html)
    print(f"report: {summary['measured_tok_s']:.1f} tok/s measured over {summary['rows']} rows")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-batch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", type=Path, required=True, help="resolved config YAML")
        p.set_defaults(func=func)
        return p

    p = command("prepare-model", _prepare_model, "build the built-in checkpoint named by the config")
    p.add_argument("--out", type=Path, required=True)
    p = command("shard", _shard, "normalize, tokenize and shard the corpus")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p = command("policy", _policy, "choose the execution policy with the performance model")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--shards", type=Path, nargs="*", default=[])
    p.add_argument("--out", type=Path, required=True)
    p = command("generate", _generate, "run the engine over one shard (resumable)")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--shard", type=Path, required=True)
    p.add_argument("--policy", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stats", type=Path, required=True)
    p.add_argument("--threads", type=int, default=0)
    p = command("merge", _merge, "merge shard outputs, verifying every input row is there once")
    p.add_argument("--shard-dir", type=Path, required=True)
    p.add_argument("--generations", type=Path, nargs="+", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--openai-out", type=Path)
    p = command("report", _report, "write report.md/report.html with plots")
    p.add_argument("--generations", type=Path, required=True)
    p.add_argument("--stats", type=Path, nargs="+", required=True)
    p.add_argument("--policy", type=Path)
    p.add_argument("--md", type=Path, required=True)
    p.add_argument("--html", type=Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
