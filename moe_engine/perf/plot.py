"""Hierarchical roofline plot of the chosen policy (MoE-Lightning Fig. 4-5 style)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, NamedTuple


def turning_points(hw: Mapping[str, Any]) -> dict[str, float]:
    """Lightning eqs. 9-10 for data on the host (level j) and compute on the device (level i):
    P1 = min(P_cpu, B_cpu I) / B_link is the intensity below which fetching the data to the
    device does not beat computing on the CPU; P2 = min(P_dev, B_dev I) / B_link the intensity
    below which the device is bound by the link. Returned as critical intensities (FLOPs/byte)."""
    p_cpu, b_cpu = hw["cpu_flops"], hw["cpu_bw"]
    p_dev, b_link = hw["device_flops"], hw["link_bw"]
    return {"cpu_ridge": p_cpu / b_cpu, "device_ridge": p_dev / hw["device_bw"],
            "p1": p_cpu / b_link, "p2": p_dev / b_link}


class RooflineMarker(NamedTuple):
    """A point of the roofline plot: an operator (or a turning point) at its operational
    intensity, drawn at the performance the named roof allows there."""

    label: str
    intensity: float
    flops: float
    roof: str
    turning_point: bool = False


def roofs(policy_json: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """The roofs the plot draws, name -> (peak FLOP/s, bandwidth B/s). A CPU-only run has the
    CPU roof alone: there is no device and no link for its operators to use."""
    hw = policy_json["hardware"]
    out = {"CPU": (hw["cpu_flops"], hw["cpu_bw"])}
    if not policy_json["roofline"].get("cpu_only"):
        out["device"] = (hw["device_flops"], hw["device_bw"])
        out["link"] = (hw["device_flops"], hw["link_bw"])
    return out


def attainable(roof: tuple[float, float], intensity: float) -> float:
    """min(P, B I): what a roof allows at an operational intensity."""
    peak, bw = roof
    return min(peak, bw * intensity)


def roofline_markers(policy_json: Mapping[str, Any]) -> list[RooflineMarker]:
    """The decode operators of the chosen policy, each on the roof of where it runs: attention
    and the MoE FFN per micro-batch on the CPU or the device, the FFN's batch over the link; for
    a device run also Lightning's turning points P1, P2 on the link roof. Operators whose
    intensity is unknown are left out."""
    roof_of, pol = roofs(policy_json), policy_json["policy"]
    intensity = policy_json["roofline"]
    cpu_only = "device" not in roof_of
    ops = [("attention", intensity.get("attention_intensity"),
            "device" if not cpu_only and pol.get("attention_on_device") else "CPU"),
           (f"MoE FFN, mu={pol['micro_batch_size']}", intensity.get("ffn_intensity_device"),
            "device" if not cpu_only and pol.get("ffn_on_device", True) else "CPU")]
    if not cpu_only:
        ops.append((f"MoE FFN over link, N={pol['batch_size']}", intensity.get("ffn_intensity_link"),
                    "link"))
    markers = [RooflineMarker(label, x, attainable(roof_of[roof], x), roof)
               for label, x, roof in ops if x is not None and math.isfinite(x) and x > 0]
    if not cpu_only:
        tp = turning_points(policy_json["hardware"])
        markers += [RooflineMarker(name, tp[key], attainable(roof_of["link"], tp[key]), "link", True)
                    for key, name in (("p1", "P1"), ("p2", "P2"))]
    return markers


_ROOF_STYLE = {"CPU": ("tab:blue", "-", "CPU roof"), "device": ("tab:green", "-", "device roof"),
               "link": ("tab:red", "--", "host-to-device link roof")}
_MARKER_COLORS = ("tab:purple", "tab:orange", "tab:brown")


def plot_roofline(policy_json: Mapping[str, Any], out_png: Path | str) -> Path:
    """Draw the compute and memory roofs of the machine with the markers of `roofline_markers`
    (the decode operators of the chosen policy and the turning points) and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hw = policy_json["hardware"]
    xs = [10 ** (e / 20.0) for e in range(-40, 101)]  # 0.01 .. 1e5 FLOPs/byte
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for name, roof in roofs(policy_json).items():
        color, ls, label = _ROOF_STYLE[name]
        ax.plot(xs, [attainable(roof, x) for x in xs], color=color, ls=ls, label=label)
    operators = 0
    for m in roofline_markers(policy_json):
        if m.turning_point:
            ax.plot([m.intensity], [m.flops], "k^")
            ax.annotate(m.label, (m.intensity, m.flops), textcoords="offset points", xytext=(4, -12))
            continue
        color = _MARKER_COLORS[operators % len(_MARKER_COLORS)]
        operators += 1
        ax.axvline(m.intensity, color=color, ls=":", lw=1.5)
        ax.plot([m.intensity], [m.flops], "o", color=color, label=f"{m.label} (I={m.intensity:.3g})")
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
