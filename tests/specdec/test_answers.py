"""The model's own answers (specdec.answers): the file bound to its model, and the drafts it gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from specdec.answers import (
    DEFAULT_ANSWERS,
    MIN_SHARE,
    AnswerIndex,
    AnswersFileError,
    LearnedAnswers,
    load_answers,
    save_answers,
)
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


def test_learned_answers_draft_what_a_tenants_output_went_on_with_where_the_context_ends_as_its_text_did():
    learned = LearnedAnswers(n=3)
    prompt, output = [1, 2, 3, 4], [10, 11, 12, 13, 14]
    learned.add("a", prompt, output)
    assert learned.draft("a", [9, 2, 3, 4], 3) == [10, 11, 12]  # the question asked again: its answer's start
    assert learned.draft("a", [7, 10, 11, 12], 8) == [13, 14]  # mid-answer; an output's end stops the draft
    assert learned.draft("a", [2, 3, 5], 8) == []  # never stood before an output token
    assert learned.draft("a", [3, 4], 8) == []  # shorter than n
    assert learned.draft("b", [9, 2, 3, 4], 3) == []  # another tenant's outputs are not its drafts
    learned.add("a", [1, 2, 3, 4], [20, 21])
    assert learned.draft("a", [2, 3, 4], 2) == [20, 21]  # the newest output where two stood after the same text


def test_learned_answers_keep_each_tenants_newest_outputs_and_the_tenants_served_last():
    learned = LearnedAnswers(max_tokens=40, max_tenants=2, n=2)
    for i in range(6):  # each output 8 tokens after a 2-token prompt tail: 11 a piece
        learned.add("a", [0, 1], [100 * (i + 1) + j for j in range(8)])
    assert learned.num_tokens("a") <= 40
    assert learned.draft("a", [0, 1], 2) == [600, 601]  # the newest
    assert learned.draft("a", [101, 102], 2) == []  # the oldest, forgotten
    learned.add("b", [0, 1], [7, 8])
    learned.add("c", [0, 1], [9, 10])
    assert learned.num_tokens("a") == 0 and learned.draft("c", [0, 1], 2) == [9, 10]  # a served longest ago
    learned.add("c", [0, 1], list(range(30)))  # longer than half a tenant's room: not kept
    assert learned.draft("c", [0, 1], 2) == [9, 10]
    with pytest.raises(ValueError):
        LearnedAnswers(max_tokens=0)
