"""bench/issue12_targets.py runs issue 12's benchmarks and judges their RESULT lines against the
issue's targets. The benchmarks themselves take ~10 minutes, so here they are replaced by canned
outputs: what is tested is the plan, the parsing and the verdicts."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import issue12_targets as it  # noqa: E402

CANNED = {
    "engine": "N= 128 ...\nRESULT new_tok_s=260.0 decode_tok_s=400.5 prefill_tok_s=600 roofline_fraction=0.7 vs_baseline=nan",
    "expert": "RESULT decode_bw_fraction=0.65 prefill_flops_fraction=0.9 vs_torch_bf16=1.07 vs_torch_fp32=3.3",
    "accuracy_1t": "RESULT predicted_tok_s=90 measured_tok_s=100 accuracy=0.9",
    "accuracy_2t": "no RESULT line at all",
    "default_run": "RESULT prediction_error=0.25 predicted_tok_s=10 engine_tok_s=8",
}


def fake(run: it.Run) -> tuple[int, str]:
    if run.name.startswith("attention_"):
        if run.name.endswith("fp32"):
            return 1, "Traceback: the benchmark failed"
        return 0, "first\nRESULT kernel_gbps=27 read_gbps=0.5 bw_fraction=0.2 isa=avx2\nRESULT bw_fraction=0.85 isa=avx2"
    return 0, CANNED[run.name]


def test_attention_is_judged_on_avx2_and_the_default_build():
    assert it.attention_isas(["generic", "avx2", "avx512", "avx512bf16"], "avx512bf16") == ["avx2", "avx512bf16"]
    assert it.attention_isas(["generic", "avx2"], "avx2") == ["avx2"]
    assert it.attention_isas(["generic"], "generic") == []


def test_the_last_result_line_counts_and_only_its_numbers():
    assert it.parse_result("RESULT a=1\nRESULT b=2.5 isa=avx2 c=nan\n") == {"b": 2.5, "c": pytest.approx(float("nan"), nan_ok=True)}
    assert it.parse_result("nothing here") == {}


def test_every_target_is_judged_with_the_issue_s_threshold(capsys, monkeypatch):
    monkeypatch.setattr(it, "attention_isas", lambda supported, default: ["avx2"])
    assert it.main([], execute=fake) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].startswith("# ") and "torch" in lines[0]  # the machine header
    result = dict(kv.split("=") for kv in lines[-1].removeprefix("RESULT ").split())
    # the engine: 260 >= 250 reached, 400.5 < 450 not, 0.7 >= 0.7 reached (the boundary counts)
    assert result["engine_new_tok_s"] == "260" and result["engine_decode_tok_s"] == "400.5"
    verdicts = {ln.split()[0]: ln for ln in lines if ln.startswith(("engine_", "expert_", "attention_",
                                                                    "model_", "default_"))}
    assert verdicts["engine_new_tok_s"].split()[4] == "reached"
    assert "NOT reached" in verdicts["engine_decode_tok_s"]
    assert verdicts["engine_roofline_fraction"].split()[4] == "reached"
    assert "NOT reached" in verdicts["expert_vs_torch_bf16"]
    assert verdicts["attention_avx2_bf16_bw_fraction"].split()[4] == "reached"  # the last RESULT line
    assert "no figure" in verdicts["attention_avx2_fp32_bw_fraction"]  # its benchmark failed
    assert "no figure" in verdicts["model_accuracy_2t"]
    assert "NOT reached" in verdicts["default_run_report_error"]  # 25% against < 20%
    assert result["attention_avx2_fp32_bw_fraction"] == "nan"
    reached = ["engine_new_tok_s", "engine_roofline_fraction", "expert_prefill_flops_fraction",
               "expert_vs_torch_fp32", "attention_avx2_bf16_bw_fraction",
               "attention_avx2_fp16_bw_fraction", "model_accuracy_1t"]
    assert result["reached"] == str(len(reached)) and result["targets"] == "13"


def test_only_runs_the_groups_asked_for(capsys):
    ran = []
    it.main(["--only", "engine,accuracy"], execute=lambda r: (ran.append(r.name), fake(r))[1])
    assert ran == ["engine", "accuracy_1t", "accuracy_2t"]
    assert "targets=5" in capsys.readouterr().out.strip().splitlines()[-1]
    with pytest.raises(SystemExit, match="engines"):
        it.main(["--only", "engines"], execute=fake)
