"""Per-request statistics as plain data: what a snapshot for the state store holds."""

from __future__ import annotations

from gateway.stats import RequestStats


def test_a_snapshot_keeps_its_counts_by_depth_while_later_steps_add_to_them():
    # The loop takes the snapshot when a step commits and writes it after the validator's check,
    # while the next step already counts its outcomes.
    stats = RequestStats()
    stats.add_depths("feature", 2, 1)
    snapshot = stats.to_dict()
    stats.add_depths("feature", 3, 3)
    stats.add_decoder("feature", 3, 3, 1.0)
    stats.add_plan(3, 1, False)
    assert snapshot["decoder_depths"] == {"feature": [1, [1, 1], [1]]}
    assert snapshot["decoders"] == {} and snapshot["num_steps_by_draft_length"] == []
    assert RequestStats.from_dict(snapshot).decoder_depths == {"feature": [1, [1, 1], [1]]}
