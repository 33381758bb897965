"""Command-line entry points; each workflow rule calls exactly one subcommand, and each
subcommand calls the stage module of the same name (`moe_engine.stages.<rule>`).

Every subcommand but prepare-model takes the resolved config written by the Snakefile
(`--config`), so a rule's behaviour is a function of that file and its inputs alone;
prepare-model takes the preset, seed and shard count that define the checkpoint, so the model
folder is shared by every results dir instead of depending on one run's config. Stage modules are imported inside
their subcommand, so a light rule never pays for torch or the engine.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from moe_engine.config import ConfigError, load_resolved


def _prepare_model(args: argparse.Namespace) -> None:
    from moe_engine.stages.prepare_model import prepare_model

    path = prepare_model(args.preset, args.seed, args.num_shards, args.out)
    print(f"{args.preset} (seed {args.seed}) at {path}")


def _shard(args: argparse.Namespace) -> None:
    from moe_engine.stages.shard import shard_corpus

    manifest = shard_corpus(load_resolved(args.config), args.model, args.out_dir)
    print(f"{manifest.num_rows} rows -> {manifest.num_shards} shards {manifest.shard_rows} "
          f"(prompt tokens {manifest.shard_tokens}), {manifest.rejected_rows} rejected")


def _policy(args: argparse.Namespace) -> None:
    from moe_engine.stages.policy import choose_policy, write_policy

    out = choose_policy(load_resolved(args.config), args.model, args.shards)
    write_policy(out, args.out)
    print(json.dumps(out.get("engine"), default=str))


def _generate(args: argparse.Namespace) -> None:
    from moe_engine.stages.generate import run_shard

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
    from moe_engine.stages.merge import merge_generations, write_openai_batch_output

    cfg = load_resolved(args.config)
    merged = merge_generations(args.shard_dir, args.generations, args.out)
    if args.openai_out is not None:
        write_openai_batch_output(merged, cfg.model.name, args.openai_out)
    print(f"merged {merged.height} rows into {args.out}")


def _report(args: argparse.Namespace) -> None:
    from moe_engine.stages.report import write_report

    summary = write_report(args.generations, args.stats, args.policy, args.md, args.html)
    rate = summary["measured_tok_s"]
    measured = f"{rate:.1f} tok/s measured" if rate is not None else "no throughput measured"
    print(f"report: {measured} over {summary['rows']} rows ({summary['resumed_rows']} resumed, "
          "excluded from throughput)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-batch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", type=Path, required=True, help="resolved config YAML")
        p.set_defaults(func=func)
        return p

    # Takes what defines the checkpoint instead of a run's config: see stages/prepare_model.py.
    p = sub.add_parser("prepare-model", help="build a built-in checkpoint unless it is built")
    p.set_defaults(func=_prepare_model)
    p.add_argument("--preset", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=1)
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
