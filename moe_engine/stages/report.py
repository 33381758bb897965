"""The run report: throughput, time split, prediction vs measurement, KV use, rejected rows.

Inputs are the workflow's own outputs (merged generations, per-shard stats, policy.json); the
report writes PNG plots with matplotlib plus report.md and report.html that embed them.
"""
from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

# Engine stats keys that split a shard's time, in plotting order: by phase (they add up to the
# engine's time) and by component (attention, FFN, ... inside both phases). Stacking the two
# kinds together would count the same seconds twice, so they get separate panels.
PHASE_KEYS = ("prefill_time_s", "decode_time_s")
COMPONENT_KEYS = ("attention_time_s", "ffn_time_s", "dense_time_s", "head_time_s",
                  "sampling_time_s", "schedule_time_s", "transfer_wait_time_s")


@dataclass(frozen=True)
class ShardSummary:
    shard: str
    rows: int
    generated_rows: int
    resumed_rows: int
    completion_tokens: int
    wall_time_s: float
    engine: dict[str, Any]

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0


def load_shard_stats(paths: list[Path]) -> list[ShardSummary]:
    out = []
    for p in sorted(paths, key=lambda p: _shard_key(p.stem)):
        s = json.loads(p.read_text())
        out.append(ShardSummary(shard=str(s["shard"]), rows=s["rows"],
                                generated_rows=s["generated_rows"], resumed_rows=s["resumed_rows"],
                                completion_tokens=s["completion_tokens"],
                                wall_time_s=s["wall_time_s"], engine=s.get("engine") or {}))
    return out


def _shard_key(stem: str) -> tuple:
    return (0, int(stem)) if stem.isdigit() else (1, stem)


def rejection_reason(error: str | None) -> str:
    """Group reasons by their kind: the text before ':' with numbers blanked."""
    if not error:
        return "unknown"
    head = error.split(":", 1)[0]
    return re.sub(r"\d+", "N", head).strip()


def summarize(merged: pl.DataFrame, shards: list[ShardSummary], policy: dict | None) -> dict[str, Any]:
    """The numbers the report shows, as one JSON-able dict (also written as summary.json)."""
    status_counts = dict(merged.group_by("status").len().sort("status").iter_rows())
    rejected = merged.filter(pl.col("status") != "ok")
    reasons: dict[str, int] = {}
    for err in rejected["error"].to_list():
        key = rejection_reason(err)
        reasons[key] = reasons.get(key, 0) + 1
    total_tokens = sum(s.completion_tokens for s in shards)
    total_time = sum(s.wall_time_s for s in shards)
    measured = total_tokens / total_time if total_time > 0 else 0.0
    predicted = _predicted_tok_s(policy)
    # The model predicts the engine's generation throughput; a shard job also loads the model
    # and writes its outputs, so the prediction is judged against the engine's own time.
    engine_time = sum(float(s.engine.get("wall_time_s") or 0.0) for s in shards)
    engine_tokens = sum(int(s.engine.get("decode_tokens") or 0) for s in shards)
    engine_tok_s = engine_tokens / engine_time if engine_time > 0 else None
    judged = engine_tok_s or measured
    return {
        "rows": merged.height,
        "status_counts": status_counts,
        "rejected_by_reason": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "completion_tokens": total_tokens,
        "prompt_tokens": int(merged["prompt_tokens"].sum() or 0),
        "generate_time_s": total_time,
        "measured_tok_s": measured,
        "engine_time_s": engine_time,
        "engine_tok_s": engine_tok_s,
        "predicted_tok_s": predicted,
        "prediction_error": (abs(predicted - judged) / judged) if predicted and judged else None,
        "bottleneck": (policy or {}).get("bottleneck"),
        "policy": (policy or {}).get("policy"),
        "preemptions": sum(int(s.engine.get("preemptions", 0)) for s in shards),
        "kernels": sorted({f"GEMM: {s.engine['gemm_path']}; attention: {s.engine['attention_path']}"
                           for s in shards if s.engine.get("gemm_path")}),
        "shards": [{"shard": s.shard, "rows": s.rows, "generated_rows": s.generated_rows,
                    "resumed_rows": s.resumed_rows, "completion_tokens": s.completion_tokens,
                    "wall_time_s": s.wall_time_s, "tok_s": s.tokens_per_s,
                    "kv_blocks_high_water": s.engine.get("kv_blocks_high_water"),
                    "kv_blocks_total": s.engine.get("kv_blocks_total"),
                    "preemptions": s.engine.get("preemptions")} for s in shards],
    }


def _predicted_tok_s(policy: dict | None) -> float | None:
    if not policy:
        return None
    for key in ("predicted_tok_s", "predicted_throughput_tok_s", "throughput_tok_s"):
        for scope in (policy, policy.get("prediction") or {}):
            if isinstance(scope.get(key), (int, float)):
                return float(scope[key])
    return None


def binned_rate(timeline: list, bins: int = 30) -> tuple[list[float], list[float]]:
    """Tokens/s in equal time bins from (elapsed_s, cumulative_tokens) samples.

    Per-step rates swing wildly (a prefill step generates one token per sequence at once), so
    the report shows the rate over bins of a few steps instead.
    """
    if len(timeline) < 2:
        return [], []
    end = timeline[-1][0]
    width = end / bins if end > 0 else 1.0
    centers, rates = [], []
    prev_t, prev_tok, j = 0.0, 0, 0
    for b in range(1, bins + 1):
        edge = b * width
        while j < len(timeline) and timeline[j][0] <= edge + 1e-12:
            j += 1
        tok = timeline[j - 1][1] if j else 0
        t = timeline[j - 1][0] if j else 0.0
        if t > prev_t:
            centers.append((prev_t + t) / 2)
            rates.append((tok - prev_tok) / (t - prev_t))
            prev_t, prev_tok = t, tok
    return centers, rates


def _plots(summary: dict, shards: list[ShardSummary], policy: dict | None, out_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}

    def save(fig, name: str, title: str) -> None:
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made[title] = path

    names = [s.shard for s in shards]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names + ["overall"], [s.tokens_per_s for s in shards] + [summary["measured_tok_s"]],
           color=["tab:blue"] * len(shards) + ["tab:green"])
    if summary.get("engine_tok_s"):
        ax.axhline(summary["engine_tok_s"], color="tab:green", ls=":", label="engine (generate only)")
    if summary["predicted_tok_s"]:
        ax.axhline(summary["predicted_tok_s"], color="tab:red", ls="--", label="predicted")
    if summary.get("engine_tok_s") or summary["predicted_tok_s"]:
        ax.legend(fontsize=8)
    ax.set_xlabel("shard")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("Generation throughput per shard")
    save(fig, "throughput", "Throughput per shard")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for s in shards:
        centers, rates = binned_rate(s.engine.get("timeline") or [])
        if centers:
            ax.plot(centers, rates, marker=".", label=f"shard {s.shard}")
    ax.set_xlabel("time since shard start (s)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("Throughput over time (binned)")
    if shards:
        ax.legend(fontsize=8)
    save(fig, "throughput_over_time", "Throughput over time")

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, keys, title in ((axes[0], PHASE_KEYS, "by phase"), (axes[1], COMPONENT_KEYS, "by component")):
        bottom = [0.0] * len(shards)
        for key in keys:
            values = [float(s.engine.get(key) or 0.0) for s in shards]
            if any(values):
                ax.bar(names, values, bottom=bottom, label=key.removesuffix("_time_s"))
                bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xlabel("shard")
        ax.set_title(f"Engine time {title}")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("seconds")
    save(fig, "time_split", "Time split by phase and component")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    used = [float(s.engine.get("kv_blocks_high_water") or 0) for s in shards]
    total = [float(s.engine.get("kv_blocks_total") or 0) for s in shards]
    percent = [100.0 * u / t if t else 0.0 for u, t in zip(used, total)]
    ax.bar(names, percent, color="tab:purple")
    for i, s in enumerate(shards):
        ax.annotate(f"{int(used[i])}/{int(total[i])} blocks\n{s.engine.get('preemptions', 0)} preempted",
                    (i, percent[i]), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 115)
    ax.set_xlabel("shard")
    ax.set_ylabel("KV blocks high-water (% of cache)")
    ax.set_title("KV cache use and preemptions")
    save(fig, "kv_cache", "KV cache use")

    reasons = summary["rejected_by_reason"]
    if reasons:
        fig, ax = plt.subplots(figsize=(6, max(2.5, 0.4 * len(reasons) + 1)))
        ax.barh(list(reasons)[::-1], list(reasons.values())[::-1], color="tab:orange")
        ax.set_xlabel("rows")
        ax.set_title("Rows not generated, by reason")
        save(fig, "rejected", "Rows not generated")

    if policy:
        try:
            from moe_engine.perf import plot_roofline

            made["Roofline of the chosen policy"] = plot_roofline(policy, out_dir / "roofline.png")
        except (ImportError, KeyError, ValueError) as exc:  # report still useful without it
            print(f"report: roofline plot skipped: {exc}")
    return made


def _markdown(summary: dict, plots: dict[str, Path], base: Path) -> str:
    pred = summary["predicted_tok_s"]
    lines = [
        "# moe-batch run report", "",
        f"- rows: {summary['rows']} ({', '.join(f'{k}: {v}' for k, v in summary['status_counts'].items())})",
        f"- generated tokens: {summary['completion_tokens']} in {summary['generate_time_s']:.1f} s of generation",
        f"- measured throughput: **{summary['measured_tok_s']:.1f} tok/s** (shard jobs end to end)",
        f"- engine throughput: {summary['engine_tok_s']:.1f} tok/s in {summary['engine_time_s']:.1f} s "
        "of `generate` (model loading and output writing excluded)" if summary.get("engine_tok_s")
        else "- engine throughput: n/a (every row was resumed from a checkpoint)",
        f"- predicted throughput: {pred:.1f} tok/s (error {summary['prediction_error']:.0%} against "
        "the engine throughput)" if pred else "- predicted throughput: n/a (no policy prediction)",
        f"- bottleneck named by the performance model: {summary['bottleneck'] or 'n/a'}",
        f"- policy: `{json.dumps(summary['policy'])}`" if summary["policy"] else "- policy: from config",
        f"- preemptions: {summary['preemptions']}",
        f"- kernels: {' | '.join(summary['kernels']) or 'n/a'}", "",
        "## Shards", "",
        "| shard | rows | generated | resumed | tokens | time (s) | tok/s | KV high-water / total | preemptions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary["shards"]:
        lines.append(f"| {s['shard']} | {s['rows']} | {s['generated_rows']} | {s['resumed_rows']} | "
                     f"{s['completion_tokens']} | {s['wall_time_s']:.1f} | {s['tok_s']:.1f} | "
                     f"{s['kv_blocks_high_water']} / {s['kv_blocks_total']} | {s['preemptions']} |")
    lines += ["", "## Rows not generated", ""]
    if summary["rejected_by_reason"]:
        lines += ["| reason | rows |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in summary["rejected_by_reason"].items()]
    else:
        lines.append("none")
    lines += ["", "## Plots", ""]
    lines += [f"### {title}\n\n![{title}]({p.relative_to(base)})\n" for title, p in plots.items()]
    return "\n".join(lines) + "\n"


def _html(markdown_text: str, plots: dict[str, Path], base: Path, summary: dict) -> str:
    """A self-contained page: the same content as the Markdown, rendered with plain HTML."""
    body = []
    in_table = False
    for line in markdown_text.splitlines():
        if line.startswith("|"):
            cells = [html.escape(c.strip()) for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-"):
                continue
            tag = "th" if not in_table else "td"
            if not in_table:
                body.append("<table>")
                in_table = True
            body.append("<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>")
            continue
        if in_table:
            body.append("</table>")
            in_table = False
        if line.startswith("!["):
            title, src = re.match(r"!\[(.*)\]\((.*)\)", line).groups()
            body.append(f'<img src="{html.escape(src)}" alt="{html.escape(title)}">')
        elif line.startswith("### "):
            body.append(f"<h3>{html.escape(line[4:])}</h3>")
        elif line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("- "):
            text = html.escape(line[2:])
            text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
            text = re.sub(r"`(.+?)`", r"<code>\1</code>", text)
            body.append(f"<li>{text}</li>")
        elif line.strip():
            body.append(f"<p>{html.escape(line)}</p>")
    if in_table:
        body.append("</table>")
    style = ("body{font-family:sans-serif;max-width:960px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;"
             "text-align:right}th{background:#f3f3f3}img{max-width:100%;margin:0.5em 0}"
             "code{background:#f3f3f3;padding:1px 3px}")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>moe-batch report</title>"
            f"<style>{style}</style></head><body>" + "\n".join(body) + "</body></html>\n")


def write_report(merged_path: Path, stats_paths: list[Path], policy_path: Path | None,
                 out_md: Path, out_html: Path) -> dict[str, Any]:
    merged = pl.read_parquet(merged_path)
    shards = load_shard_stats(stats_paths)
    policy = json.loads(policy_path.read_text()) if policy_path and policy_path.exists() else None
    summary = summarize(merged, shards, policy)
    base = out_md.parent
    plots = _plots(summary, shards, policy, base / "plots")
    markdown_text = _markdown(summary, plots, base)
    out_md.write_text(markdown_text, encoding="utf-8")
    out_html.write_text(_html(markdown_text, plots, base, summary), encoding="utf-8")
    (base / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary
