"""Hierarchical roofline plot of the chosen policy (MoE-Lightning Fig. 4-5 style)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping


def turning_points(hw: Mapping[str, Any]) -> dict[str, float]:
    """Lightning eqs. 9-10 for data on the host (level j) and compute on the device (level i):
    P1 = min(P_cpu, B_cpu I) / B_link is the intensity below which fetching the data to the
    device does not beat computing on the CPU; P2 = min(P_dev, B_dev I) / B_link the intensity
    below which the device is bound by the link. Returned as critical intensities (FLOPs/byte)."""
    p_cpu, b_cpu = hw["cpu_flops"], hw["cpu_bw"]
    p_dev, b_link = hw["device_flops"], hw["link_bw"]
    return {"cpu_ridge": p_cpu / b_cpu, "device_ridge": p_dev / hw["device_bw"],
            "p1": p_cpu / b_link, "p2": p_dev / b_link}


def plot_roofline(policy_json: Mapping[str, Any], out_png: Path | str) -> Path:
    """Draw the compute and memory roofs of the machine with the decode operators of the chosen
    policy (attention, MoE FFN per micro-batch and per batch over the link) and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hw, roof, pol = policy_json["hardware"], policy_json["roofline"], policy_json["policy"]
    cpu_only = bool(roof.get("cpu_only"))
    xs = [10 ** (e / 20.0) for e in range(-40, 101)]  # 0.01 .. 1e5 FLOPs/byte
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    ax.plot(xs, [min(hw["cpu_flops"], hw["cpu_bw"] * x) for x in xs], color="tab:blue", label="CPU roof")
    if not cpu_only:
        ax.plot(xs, [min(hw["device_flops"], hw["device_bw"] * x) for x in xs], color="tab:green",
                label="device roof")
        ax.plot(xs, [min(hw["device_flops"], hw["link_bw"] * x) for x in xs], color="tab:red", ls="--",
                label="host-to-device link roof")
    ops = [("attention", roof.get("attention_intensity"), "tab:purple"),
           (f"MoE FFN, mu={pol['micro_batch_size']}", roof.get("ffn_intensity_device"), "tab:orange")]
    if not cpu_only and roof.get("ffn_intensity_link"):
        ops.append((f"MoE FFN over link, N={pol['batch_size']}", roof["ffn_intensity_link"], "tab:brown"))
    for label, x, color in ops:
        if x is None or not math.isfinite(x):
            continue
        ax.axvline(x, color=color, ls=":", lw=1.5)
        roof_y = hw["cpu_bw"] * x if cpu_only else min(hw["device_flops"], hw["device_bw"] * x)
        if "link" in label:
            roof_y = min(hw["device_flops"], hw["link_bw"] * x)
        if label == "attention" and not pol.get("attention_on_device"):
            roof_y = min(hw["cpu_flops"], hw["cpu_bw"] * x)
        ax.plot([x], [roof_y], "o", color=color, label=f"{label} (I={x:.3g})")
    if not cpu_only:
        tp = turning_points(hw)
        for key, marker in (("p1", "P1"), ("p2", "P2")):
            x = tp[key]
            ax.plot([x], [hw["link_bw"] * x], "k^")
            ax.annotate(marker, (x, hw["link_bw"] * x), textcoords="offset points", xytext=(4, -12))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("operational intensity (FLOPs / byte)")
    ax.set_ylabel("attainable performance (FLOP/s)")
    pred = policy_json["prediction"]
    ax.set_title(f"{hw['name']}: predicted {pred['throughput_tok_s']:.1f} tok/s, "
                 f"bottleneck {policy_json['bottleneck']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
