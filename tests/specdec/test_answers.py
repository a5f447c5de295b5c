"""The model's own answers (specdec.answers): the file bound to its model, and the drafts it gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from specdec.answers import DEFAULT_ANSWERS, MIN_SHARE, AnswerIndex, AnswersFileError, load_answers, save_answers
from specdec.suffix_array import SEPARATOR

FINGERPRINT = "f" * 32
ANSWERS = [[10, 11, 12, 13], [20, 11, 12, 13], [30, 11, 12, 14], [40, 41, 42]]


def written(tmp_path: Path, answers=ANSWERS, fingerprint: str = FINGERPRINT) -> Path:
    path = tmp_path / "answers.safetensors"
    save_answers(path, answers, fingerprint, {"command": "test", "sources": {"test": "CC0"}})
    return path


def test_a_written_file_loads_for_its_model_and_drafts_the_continuation_most_answers_agree_on(tmp_path):
    index = load_answers(written(tmp_path), vocab_size=64, expected_fingerprint=FINGERPRINT)
    assert index.num_tokens == sum(len(a) + 1 for a in ANSWERS)
    assert index.draft([5, 11, 12], 2) == [13]  # 13 follows "11 12" twice, 14 once; an answer ends after
    assert index.continuation([5, 11, 12], 2) == ([13], pytest.approx(2 / 3))
    assert index.draft([40, 41], 4) == [42]
    assert index.draft([5, 6], 4) == []  # "5 6" occurs nowhere
    assert index.draft([12], 4) == []  # one token is too short a match
    assert index.draft([5, 11, 12], 0) == []


def test_a_continuation_few_answers_agree_on_is_not_drafted():
    split = [[1, 2, v] for v in range(10, 20)]  # "1 2" continues ten ways, a tenth each
    tokens = np.concatenate([np.append(a, SEPARATOR) for a in split]).astype(np.int32)
    index = AnswerIndex(tokens, vocab_size=64)
    path, share = index.continuation([1, 2], 1)
    assert len(path) == 1 and share == pytest.approx(0.1) and share < MIN_SHARE
    assert index.draft([1, 2], 1) == []


def test_a_file_of_another_model_is_refused_naming_both(tmp_path):
    with pytest.raises(
        AnswersFileError, match=f"written for model {'a' * 32}, but the primary serves model {FINGERPRINT}"
    ):
        load_answers(written(tmp_path, fingerprint="a" * 32), 64, FINGERPRINT)


def test_a_truncated_file_of_another_format_or_with_foreign_ids_is_refused(tmp_path):
    path = written(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(AnswersFileError, match="not a safetensors file"):
        load_answers(path, 64, FINGERPRINT)
    with pytest.raises(AnswersFileError, match="No such file"):
        load_answers(tmp_path / "missing.safetensors", 64, FINGERPRINT)
    with pytest.raises(AnswersFileError, match="outside the model's vocabulary of 32"):
        load_answers(written(tmp_path), 32, FINGERPRINT)
    other = tmp_path / "other.safetensors"
    save_file({"tokens": np.arange(4, dtype=np.int32)}, str(other), metadata={"format": "something-else"})
    with pytest.raises(AnswersFileError, match="format 'something-else'; this version reads 'specdec-answers-1'"):
        load_answers(other, 64, FINGERPRINT)


def test_the_shipped_answers_are_the_default_model_s(default_model_fingerprint):
    """The file that ships for the default model loads for it (its fingerprint, its vocabulary)."""
    index = load_answers(DEFAULT_ANSWERS, 49152, default_model_fingerprint)
    assert index.num_tokens > 100_000
