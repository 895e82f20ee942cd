"""The real-model suite's rounds: variants run in turn, and each row merges its variant's rounds."""

from __future__ import annotations

import pytest

from benchmarks import hf


def _row(variant: str, step_ms: float, p10: float, p90: float) -> dict:
    return {
        "model": "1b",
        "scenario": "full",
        "variant": variant,
        "step_ms": step_ms,
        "step_ms_p10_p90": [p10, p90],
        "tokens_per_s": hf.BATCH * hf.SEQUENCE / (step_ms * 1e-3),
        "tflops": 500.0 * 100.0 / step_ms,
        "fp8_peak_share": 0.25,
        "peak_mib_above_model": 6000.0,
        "first_call_s": 100.0,
        "grad_cosine": {"q_proj": 0.88},
    }


def test_rounds_run_the_variants_in_turn_and_rows_take_the_median_round(monkeypatch, tmp_path):
    times = {"a": [130.0, 110.0, 120.0], "b": [100.0, 104.0, 98.0]}
    order = []

    def worker(result, case, **_):
        variant = case[2]
        order.append((variant, result.name))
        step = times[variant][sum(v == variant for v, _ in order) - 1]
        return _row(variant, step, step - 5, step + 5)

    monkeypatch.setattr(hf, "_run_worker_process", worker)
    rows = hf.run_suite(
        tmp_path,
        models=["1b"],
        scenarios=["full"],
        variants=["a", "b"],
        warmup=1,
        steps=2,
        timeout_s=1,
        rounds=3,
    )
    assert [v for v, _ in order] == ["a", "b"] * 3
    assert len({name for _, name in order}) == 6  # each round writes a file of its own
    a, b = rows
    assert (a["variant"], a["step_ms"], a["step_ms_rounds"]) == ("a", 120.0, [130.0, 110.0, 120.0])
    assert a["step_ms_p10_p90"] == [105.0, 135.0]
    assert a["tokens_per_s"] == pytest.approx(hf.BATCH * hf.SEQUENCE / 0.120)
    assert a["tflops"] == pytest.approx(500.0 * 100.0 / 120.0)
    assert b["step_ms"] == 100.0


def test_a_failed_round_is_counted_and_an_all_failed_variant_keeps_its_error():
    failed = {"model": "1b", "scenario": "full", "variant": "a", "error": "timed out after 1 s"}
    merged = hf.merged_rounds([failed, _row("a", 120.0, 110.0, 130.0), _row("a", 100.0, 95.0, 105.0)])
    assert merged["step_ms"] == 110.0 and merged["failed_rounds"] == 1
    assert hf.merged_rounds([failed, dict(failed, error="other")])["error"] == "timed out after 1 s"
    single = _row("a", 120.0, 110.0, 130.0)
    assert hf.merged_rounds([single]) == single
