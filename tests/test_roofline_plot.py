"""The roofline plot's markers sit on or under the roof of where their operator runs, for a
CPU-only policy and a device policy (policy JSON built as the policy stage builds it)."""
from __future__ import annotations

import json

import pytest

from moe_engine.perf import WorkloadSpec, choose_policy, load_preset
from moe_engine.perf.plot import plot_roofline, roofline_markers
from moe_engine.perf.reference_models import reference_model

OLMOE = reference_model("olmoe-1b-7b")  # fits the CPU preset's memory
MIXTRAL = reference_model("mixtral-8x7b")  # streams experts over an L4's link
MTBENCH = WorkloadSpec(mean_prompt=77, max_prompt=418, gen_len=128)


def policy_json(model, preset: str, backend: str) -> dict:
    """policy.json's content for a model on a hardware preset (plain JSON types only)."""
    result = choose_policy(model, load_preset(preset), MTBENCH, backend=backend)
    return {"source": "search", **json.loads(json.dumps(result.to_json()))}


def roof_figures(hw: dict, roof: str) -> tuple[float, float]:
    """(peak FLOP/s, bandwidth) of a roof, from the hardware figures, independently of plot.py."""
    return {"CPU": (hw["cpu_flops"], hw["cpu_bw"]),
            "device": (hw["device_flops"], hw["device_bw"]),
            "link": (hw["device_flops"], hw["link_bw"])}[roof]


def assert_on_or_under_roofs(data: dict) -> None:
    markers = roofline_markers(data)
    assert markers
    for m in markers:
        peak, bw = roof_figures(data["hardware"], m.roof)
        assert 0 < m.flops <= min(peak, bw * m.intensity) * (1 + 1e-12), m


@pytest.fixture(scope="module")
def cpu_policy() -> dict:
    data = policy_json(OLMOE, "cpu", "cpu")
    assert data["roofline"]["cpu_only"]
    return data


@pytest.fixture(scope="module")
def device_policy() -> dict:
    data = policy_json(MIXTRAL, "l4", "cuda")
    assert not data["roofline"]["cpu_only"] and data["roofline"]["ffn_intensity_link"]
    return data


def test_cpu_only_markers_sit_on_or_under_the_cpu_roof(cpu_policy):
    assert_on_or_under_roofs(cpu_policy)
    assert {m.roof for m in roofline_markers(cpu_policy)} == {"CPU"}
    # This policy's FFN micro-batch is compute bound on the CPU preset: the case that used to be
    # drawn at B_cpu * I, above the roof.
    hw, ffn = cpu_policy["hardware"], cpu_policy["roofline"]["ffn_intensity_device"]
    assert hw["cpu_bw"] * ffn > hw["cpu_flops"]


def test_cpu_only_ffn_marker_is_capped_by_cpu_compute_at_high_intensity(cpu_policy):
    # An FFN micro-batch big enough to be compute bound: the marker stops at the CPU's FLOP/s
    # (it used to be drawn at B_cpu * I, far above the roof).
    data = json.loads(json.dumps(cpu_policy))
    hw = data["hardware"]
    data["roofline"]["ffn_intensity_device"] = 100 * hw["cpu_flops"] / hw["cpu_bw"]
    assert_on_or_under_roofs(data)
    ffn = next(m for m in roofline_markers(data) if m.label.startswith("MoE FFN"))
    assert ffn.flops == pytest.approx(hw["cpu_flops"])


def test_device_markers_sit_on_or_under_their_roofs(device_policy):
    assert_on_or_under_roofs(device_policy)
    markers = {m.label.split(",")[0]: m for m in roofline_markers(device_policy)}
    pol = device_policy["policy"]
    assert markers["attention"].roof == ("device" if pol["attention_on_device"] else "CPU")
    assert markers["MoE FFN"].roof == ("device" if pol["ffn_on_device"] else "CPU")
    assert markers["MoE FFN over link"].roof == markers["P1"].roof == markers["P2"].roof == "link"


def test_plot_draws_both_kinds_of_policy(tmp_path, cpu_policy, device_policy):
    for name, data in (("cpu", cpu_policy), ("device", device_policy)):
        png = plot_roofline(data, tmp_path / f"{name}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
