"""Drafter files for the default model: the suite's random one (tests/conftest.py's feature_drafter_path,
which the exactness tests serve) binds to the loaded model as the pool binds it, and the shipped one
(draft_svc/heads/trained/, the pool's --feature_drafter default) was trained for the default model."""

from __future__ import annotations

import pytest

from draft_svc.config import DEFAULT_FEATURE_DRAFTER
from draft_svc.heads import file as drafter_file
from specdec.model.fingerprint import model_fingerprint
from draft_svc.strategies.feature import FeatureDrafterSource
from specdec.model import loader


def test_the_suites_drafter_file_binds_to_the_default_model(
    feature_drafter_path, default_model_fingerprint, fp32_model
):
    """The fixture's fingerprint (read from the checkpoint) is the loaded model's, so a pool serving the
    default model at any precision binds the file instead of refusing it."""
    model = fp32_model.model
    assert model_fingerprint(model.config, model.norm.weight) == default_model_fingerprint
    loaded = drafter_file.load(feature_drafter_path, expected_fingerprint=default_model_fingerprint)
    assert loaded.config.vocab_size == model.config.vocab_size
    assert loaded.config.hidden_size == model.config.hidden_size
    source = FeatureDrafterSource(feature_drafter_path)
    assert source.bind(model) is not None and source.refusal() is None


def test_the_shipped_drafter_file_was_trained_for_the_default_model(
    default_gguf_path, default_model_dir, default_model_fingerprint
):
    if not DEFAULT_FEATURE_DRAFTER.exists():
        pytest.skip(f"no shipped drafter file at {DEFAULT_FEATURE_DRAFTER} (python -m draft_svc.heads writes one)")
    # The file is named for the model it serves; the tests' model is the default one (tests/conftest.py)
    served = DEFAULT_FEATURE_DRAFTER.stem.lower()
    if not default_gguf_path.stem.lower().startswith(served):
        pytest.skip(f"the tests' model {default_gguf_path.name} is not the shipped drafter's {served}")
    loaded = drafter_file.load(DEFAULT_FEATURE_DRAFTER, expected_fingerprint=default_model_fingerprint)
    config = loader.load_config(default_model_dir)
    assert (loaded.config.vocab_size, loaded.config.hidden_size) == (config.vocab_size, config.hidden_size)
    assert loaded.model_fingerprint == default_model_fingerprint
