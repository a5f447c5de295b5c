"""--precision auto: the score of a verify curve, the choice, its cache, and the fallback."""

from __future__ import annotations

import json
import threading
import types

import pytest

from primary_svc import autotune
from primary_svc.autotune import (
    AUTOTUNE_STAGE,
    PROBE_SIZES,
    choose_precision,
    choose_precision_or_fallback,
    expected_tokens_per_s,
    measure_candidate,
)

FLAT = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0}  # verifying 16 costs what 1 does
STEEP = {1: 5.0, 2: 10.0, 4: 20.0, 8: 40.0, 16: 80.0}  # cost linear in rows


def test_plain_decoding_when_nothing_is_accepted():
    # alpha = 0: every draft is rejected, so the best is plain: 1 token per (10 + 1) ms.
    assert expected_tokens_per_s(FLAT, 0.0) == pytest.approx(1000 / 11)


def test_a_flat_curve_drafts_as_far_as_it_can():
    # alpha = 1 on a flat curve: 17 tokens per (10 + 4) ms at the longest draft.
    assert expected_tokens_per_s(FLAT, 1.0) == pytest.approx(17 * 1000 / 14)


def test_the_curve_past_its_last_point_continues_its_last_slope():
    # Only k = 1, 2 measured: 17 rows cost 5 + 15 * 5 = 80 ms; alpha = 1 makes 17 tokens the best.
    assert expected_tokens_per_s({1: 5.0, 2: 10.0}, 1.0) == pytest.approx(
        max((g + 1) * 1000 / (5.0 * (g + 1) + (1.0 if g == 0 else 4.0)) for g in range(17))
    )


def test_a_steep_fast_format_can_beat_a_flat_slow_one_and_vice_versa():
    assert autotune.score(STEEP) > autotune.score({k: 4 * v for k, v in FLAT.items()})
    assert autotune.score({k: 0.5 * v for k, v in FLAT.items()}) > autotune.score(STEEP)


def curves(**by_precision):
    def measure(model_dir, precision):
        value = by_precision[precision]
        if isinstance(value, Exception):
            raise value
        return value

    return measure


def test_choice_is_measured_then_cached_per_machine_and_model(tmp_path, monkeypatch):
    model_dir = tmp_path / "model-abc"
    measured = []

    def measure(model_dir, precision):
        measured.append(precision)
        return {"fp32": {k: v / 2 for k, v in FLAT.items()}, "bf16": FLAT}[precision]

    first = choose_precision(model_dir, tmp_path, 2, ("bf16", "fp32"), measure)
    assert first.precision == "fp32" and not first.is_cached and measured == ["bf16", "fp32"]
    assert "fp32" in first.reason and "bf16" in first.reason
    again = choose_precision(model_dir, tmp_path, 2, ("bf16", "fp32"), measure)
    assert again.precision == "fp32" and again.is_cached and measured == ["bf16", "fp32"]
    assert again.verify_ms["fp32"] == {k: v / 2 for k, v in FLAT.items()}
    choose_precision(tmp_path / "other-model", tmp_path, 2, ("bf16", "fp32"), measure)
    assert measured == ["bf16", "fp32"] * 2  # another model is measured anew


def test_a_candidate_that_fails_is_skipped_with_its_reason(tmp_path):
    choice = choose_precision(
        tmp_path / "m", tmp_path, 2, ("bf16", "fp32"), curves(bf16=ValueError("no bf16 kernel for lm_head"), fp32=FLAT)
    )
    assert choice.precision == "fp32" and "no bf16 kernel for lm_head" in choice.reason


def test_auto_never_fails(tmp_path, monkeypatch):
    choice = choose_precision(tmp_path / "m", tmp_path, 2, ("bf16",), curves(bf16=RuntimeError("boom")))
    assert choice.precision == "fp32" and "boom" in choice.reason

    def broken(*args, **kwargs):
        raise OSError("cache directory is read-only")

    monkeypatch.setattr(autotune, "choose_precision", broken)
    choice = choose_precision_or_fallback(tmp_path / "m", tmp_path, 2)
    assert choice.precision == "fp32" and "read-only" in choice.reason


def test_unknown_candidates_are_ignored(tmp_path):
    choice = choose_precision(tmp_path / "m", tmp_path, 2, ("fp64", "fp32"), curves(fp32=FLAT))
    assert choice.precision == "fp32" and set(choice.tokens_per_s) == {"fp32"}


def test_the_budget_stops_measuring_and_the_incomplete_choice_is_kept(tmp_path):
    """A busy start measures only the first candidates; a later start (a restart of that primary,
    which the gateway re-prefills mid-request) serves the same format, not a new measurement's."""
    measured = []

    def slow(model_dir, precision):
        measured.append(precision)
        return {"bf16": FLAT, "fp32": {k: v / 2 for k, v in FLAT.items()}}[precision]

    choice = choose_precision(tmp_path / "m", tmp_path, 2, ("bf16", "fp32"), slow, max_measure_s=0.0)
    assert measured == ["bf16"] and choice.precision == "bf16" and "fp32: not measured" in choice.reason
    again = choose_precision(tmp_path / "m", tmp_path, 2, ("bf16", "fp32"), slow)  # would pick fp32
    assert again.is_cached and again.precision == "bf16" and measured == ["bf16"]


def test_contenders_are_measured_again_backwards_and_each_size_keeps_its_fastest_run(tmp_path):
    """A noisy stretch during one candidate's pass (bf16's first, here) must not decide: the candidates
    within reach of the best are measured again, last first, and each size keeps its fastest run."""
    measured = []
    slow_then_fast = iter([{k: 1.2 * v for k, v in FLAT.items()}, {k: 0.9 * v for k, v in FLAT.items()}])

    def measure(model_dir, precision):
        measured.append(precision)
        return next(slow_then_fast) if precision == "bf16" else FLAT

    choice = choose_precision(tmp_path / "m", tmp_path, 2, ("bf16", "fp32"), measure)
    assert measured == ["bf16", "fp32", "fp32", "bf16"]
    assert choice.precision == "bf16" and choice.verify_ms["bf16"] == {k: 0.9 * v for k, v in FLAT.items()}


def test_a_candidate_far_behind_is_not_measured_again(tmp_path):
    measured = []

    def measure(model_dir, precision):
        measured.append(precision)
        return {"int4": FLAT, "int8": FLAT, "fp32": {k: 4 * v for k, v in FLAT.items()}}[precision]

    choose_precision(tmp_path / "m", tmp_path, 2, ("int4", "int8", "fp32"), measure)
    assert measured == ["int4", "int8", "fp32", "int8", "int4"]


def test_the_preferred_candidate_is_served_where_it_scores_within_the_tie_share_of_the_best(tmp_path):
    slightly_faster = {k: v * (1 - (1 - autotune.TIE_SHARE) / 2) for k, v in FLAT.items()}
    choice = choose_precision(tmp_path / "a", tmp_path, 2, ("bf16", "fp32"), curves(bf16=FLAT, fp32=slightly_faster))
    assert choice.precision == "bf16" and choice.tokens_per_s["fp32"] > choice.tokens_per_s["bf16"]
    assert "preferred within 5 % of the best" in choice.reason
    clearly_faster = {k: 0.9 * v for k, v in FLAT.items()}
    choice = choose_precision(tmp_path / "b", tmp_path, 2, ("bf16", "fp32"), curves(bf16=FLAT, fp32=clearly_faster))
    assert choice.precision == "fp32" and "preferred" not in choice.reason


def test_starts_at_once_serve_one_choice(tmp_path):
    """Two primaries starting together (a cluster's nodes, a restart beside another start) whose own
    measurements would pick different formats: the second waits for the first's choice and serves
    it, so a request moved between them (failover, re-prefill) keeps its greedy output."""
    first_measuring, second_measured = threading.Event(), threading.Event()
    choices: dict[str, autotune.PrecisionChoice] = {}

    def favouring(precision: str, wait_for_other: bool):
        def measure(model_dir, candidate):
            if wait_for_other:  # the first start measures; the second one would measure meanwhile
                first_measuring.set()
                second_measured.wait(timeout=2)
            else:
                second_measured.set()
            return FLAT if candidate == precision else {k: 2 * v for k, v in FLAT.items()}

        return measure

    waits = []

    def start(name: str, precision: str, wait_for_other: bool) -> None:
        measure = favouring(precision, wait_for_other)
        on_progress = (lambda *event: None) if wait_for_other else (lambda *event: waits.append(event))
        choices[name] = choose_precision(
            tmp_path / "m", tmp_path, 2, ("bf16", "fp32"), measure, on_progress=on_progress
        )

    first = threading.Thread(target=start, args=("first", "bf16", True))
    first.start()
    assert first_measuring.wait(timeout=30)
    second = threading.Thread(target=start, args=("second", "fp32", False))
    second.start()
    first.join(timeout=30)
    second.join(timeout=30)
    assert choices["first"].precision == choices["second"].precision == "bf16"
    assert choices["second"].is_cached and not second_measured.is_set()
    assert waits == [(AUTOTUNE_STAGE, 0, 2, autotune.WAITING_DETAIL)]  # the second start said why it waited


def test_starts_of_other_models_at_once_keep_each_others_entries(tmp_path):
    """Each write is a read-modify-write of the one file: without the lock, starts at once lost each
    other's entries, and a lost entry's next start (a restart) measured, and could choose, anew."""
    measure = curves(bf16=FLAT, fp32={k: v / 2 for k, v in FLAT.items()})
    models = [f"model-{i}" for i in range(8)]
    starts = [
        threading.Thread(target=choose_precision, args=(tmp_path / m, tmp_path, 2, ("bf16", "fp32"), measure))
        for m in models
    ]
    for t in starts:
        t.start()
    for t in starts:
        t.join(timeout=30)
    entries = json.loads((tmp_path / autotune.CACHE_FILE).read_text())
    assert sorted(key.rsplit("/", 1)[1] for key in entries) == models


def test_the_measurement_reports_its_progress_and_the_cached_choice_does_not(tmp_path):
    events = []

    def on_progress(stage, done, total, detail=""):
        events.append((stage, done, total, detail))

    fast = {k: v / 2 for k, v in FLAT.items()}
    measure = curves(bf16=FLAT, fp32=fast)
    choice = choose_precision(tmp_path / "m", tmp_path, 2, ("bf16", "fp32"), measure, on_progress=on_progress)
    assert events == [
        (AUTOTUNE_STAGE, 0, 2, "timing bf16"),
        (AUTOTUNE_STAGE, 1, 2, "timing fp32"),
        (AUTOTUNE_STAGE, 2, 2, f"chose {choice.precision}"),
    ]
    events.clear()
    choose_precision(
        tmp_path / "m", tmp_path, 2, ("bf16", "fp32"), curves(bf16=FLAT, fp32=fast), on_progress=on_progress
    )
    assert events == []  # cached: nothing to wait for


def test_int8_token_is_a_candidate_only_where_its_products_have_a_vector_path(monkeypatch):
    from specdec.model import native

    assert "int8_token" in autotune.CANDIDATES
    lib = native.library()
    is_vector = lib is not None and lib.qgemm_isa().decode() in ("AVX2", "AVX2+VNNI", "AVX512+VNNI")
    assert ("int8_token" in autotune.quantized_candidates()) == is_vector
    portable = types.SimpleNamespace(qgemm_isa=lambda: b"portable")
    for unvectorized in (None, portable):
        monkeypatch.setattr(native, "library", lambda lib=unvectorized: lib)
        assert autotune.quantized_candidates() == tuple(p for p in autotune.CANDIDATES if p != "int8_token")


def test_a_candidate_is_measured_on_the_real_model_within_its_probe_engine(default_model_dir):
    """measure_candidate's engine holds its whole measurement (every verify commits a token): a curve
    over every probe size, not an error that would leave auto with nothing but fp32."""
    curve = measure_candidate(default_model_dir, "int4")
    assert set(curve) == set(PROBE_SIZES) and all(ms > 0 for ms in curve.values())
