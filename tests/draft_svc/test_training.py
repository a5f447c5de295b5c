"""The drafter's training loop (draft_svc/heads/train.py) on answers whose next token follows from the
last one: it learns them, the same seed gives the same drafter, and the validation keeps a prompt's
answers together."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draft_svc.heads import train
from draft_svc.heads.generate import Sequence_
from tests.draft_svc.tiny_drafter import TINY, tiny_parts

NUM_TOKENS = 48  # answer length


def counting_answers(num_prompts: int, answers_per_prompt: int = 2) -> tuple[list[Sequence_], torch.Tensor]:
    """Answers that count through the draft vocabulary (token i+1 after token i, wrapping), each row's
    feature a fixed vector of the token the primary chooses next; -> (answers, the feature table)."""
    gen = torch.Generator().manual_seed(1)
    _, shared = tiny_parts()
    vocab = shared.vocab.numpy()
    n = len(vocab)
    table = torch.randn(n, TINY.hidden_size, generator=gen)
    answers = []
    for prompt in range(num_prompts):
        for a in range(answers_per_prompt):
            ranks = (prompt * 7 + a * 3 + np.arange(NUM_TOKENS + 1)) % n
            tokens = vocab[ranks].astype(np.int32)
            argmax = tokens[1:]  # greedy: the token after row t is a_t
            features = table[ranks[1:]].numpy().astype(np.float16)  # f_t, from which the head reads a_t
            answers.append(Sequence_("count", False, tokens, features, argmax.astype(np.int32), prompt_key=prompt))
    return answers, table


def fit(answers: list[Sequence_], **settings: object) -> train.Accuracy:
    return fit_drafter(answers, **settings)[1]


def fit_drafter(answers: list[Sequence_], **settings: object) -> tuple[torch.nn.Module, train.Accuracy]:
    _, shared = tiny_parts()
    train_idx, val_idx = train.split(answers, 0.2, seed=0)
    options: dict[str, object] = {"epochs": 6, "batch_tokens": 64, "lr": 3e-3, "warmup_steps": 5, "depth": 2}
    options.update(settings, window=32)
    config = train.TrainSettings(draft_vocab_size=TINY.draft_vocab_size, **options)  # type: ignore[arg-type]
    return train.train(answers, TINY, shared, config, train_idx, val_idx, log=lambda _: None)


def test_the_validation_split_keeps_a_prompts_answers_on_one_side():
    answers, _ = counting_answers(10, answers_per_prompt=3)
    train_idx, val_idx = train.split(answers, 0.2, seed=0)
    assert sorted(train_idx + val_idx) == list(range(len(answers))) and val_idx
    held_out = {answers[i].prompt_key for i in val_idx}
    assert held_out.isdisjoint(answers[i].prompt_key for i in train_idx)


def test_training_learns_a_rule_it_can_read_from_the_features():
    """Chance is 1 in 20; counting is learnt from the training prompts and holds on the held-out ones,
    one draft deep and two."""
    answers, _ = counting_answers(12)
    accuracy = fit(answers)
    assert accuracy.num_rows > 0
    assert accuracy.top1[0] > 0.5 and accuracy.top1[1] > 0.3, accuracy
    assert all(k >= t for k, t in zip(accuracy.topk, accuracy.top1, strict=True))


def test_the_same_seed_trains_the_same_drafter():
    answers, _ = counting_answers(6)
    (first, first_accuracy), (second, second_accuracy) = fit_drafter(answers, epochs=2), fit_drafter(answers, epochs=2)
    assert (first_accuracy.top1, first_accuracy.topk) == (second_accuracy.top1, second_accuracy.topk)
    weights, again = first.state_dict(), second.state_dict()
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
    other, _ = fit_drafter(answers, epochs=2, seed=1)
    assert not all(torch.equal(weights[k], v) for k, v in other.state_dict().items())


def test_distilling_takes_the_primarys_distribution_over_the_vocabulary_as_the_target():
    """distill 1: the cross-entropy's target is softmax(head(f_{t+1})) over the drafter's vocabulary
    (EAGLE's), not the greedy token; 0 leaves the greedy token's loss as it was; between, a mix."""
    answers, _ = counting_answers(4)
    drafter, shared = tiny_parts()
    row_of = torch.full((TINY.vocab_size,), -100, dtype=torch.int64)
    row_of[shared.vocab] = torch.arange(len(shared.vocab))
    batch = train.make_batch(answers, train.pieces(answers, range(4), window=32)[:4], shared, row_of)
    with torch.no_grad():
        hard, (logits,) = train.losses(drafter, shared, batch, 1, keep_logits=True, cls_weight=1.0)
        soft, _ = train.losses(drafter, shared, batch, 1, cls_weight=1.0, distill=1.0)
        half, _ = train.losses(drafter, shared, batch, 1, cls_weight=1.0, distill=0.5)
        unchanged, _ = train.losses(drafter, shared, batch, 1, cls_weight=1.0, distill=0.0)
        target = (batch.next_features @ shared.head.T).softmax(-1)[batch.valid]
        expected_soft_ce = -(target * logits[batch.valid].log_softmax(-1)).sum(-1).mean()
        labels = batch.labels[batch.valid]
        hard_ce = torch.nn.functional.cross_entropy(logits[batch.valid], labels, ignore_index=-100)
    assert torch.equal(unchanged, hard)
    assert float(soft - hard) == pytest.approx(float(expected_soft_ce - hard_ce), rel=0.05, abs=0.02)
    assert float(half) == pytest.approx((float(soft) + float(hard)) / 2, rel=1e-4)


@pytest.mark.parametrize("batch_tokens", [32, 256])
def test_batches_hold_about_batch_tokens_rows_and_every_piece_once(batch_tokens):
    answers, _ = counting_answers(6)
    items = train.pieces(answers, range(len(answers)), window=32)
    groups = train.batches(items, batch_tokens, None)
    assert sorted((p.seq, p.start) for g in groups for p in g) == sorted((p.seq, p.start) for p in items)
    for g in groups:
        rows = max(p.end - p.start for p in g) * len(g)
        assert rows <= batch_tokens or len(g) == 1


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [("--epochs", "0", "epochs"), ("--batch_tokens", "0", "batch_tokens"), ("--lr", "0", "lr"),
     ("--lr", "nan", "lr"), ("--depth", "-1", "depth"), ("--cls_weight", "-1", "cls_weight"),
     ("--distill", "1.5", "distill")],
)  # fmt: skip
def test_the_command_refuses_bad_settings_before_it_generates_anything(capsys, flag, value, named):
    from draft_svc.heads.__main__ import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["train", "--out", "x.safetensors", flag, value])
    assert e.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "flag", "value", "named"),
    [("train", "--tokens", "0", "--tokens"), ("answers", "--prompts", "0", "--prompts"),
     ("train", "--batch", "0", "--batch"), ("answers", "--max_new_tokens", "-1", "--max_new_tokens"),
     ("train", "--num_threads", "-2", "--num_threads")],
)  # fmt: skip
def test_the_command_refuses_bad_generation_flags_before_it_loads_the_model(capsys, command, flag, value, named):
    from draft_svc.heads.__main__ import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args([command, "--out", "x.safetensors", flag, value])
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_the_command_refuses_an_out_or_data_it_cannot_write_before_it_loads_the_model(capsys, tmp_path):
    """--out a directory failed only at the final rename, after the hour of generating and training."""
    from draft_svc.heads.__main__ import parse_args

    (tmp_path / "a_file").write_text("")
    for argv in (
        ["train", "--out", str(tmp_path)],
        ["answers", "--out", str(tmp_path / "a_file" / "x.safetensors")],
        ["train", "--out", "x.safetensors", "--data", str(tmp_path)],
    ):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and str(tmp_path) in err, argv
    # a missing directory is made, an existing file replaced
    args = parse_args(["train", "--out", str(tmp_path / "new" / "d.safetensors"), "--data", str(tmp_path / "a_file")])
    assert args.out == tmp_path / "new" / "d.safetensors"


def test_a_vocab_larger_than_the_models_is_refused_before_the_model_answers(monkeypatch, capsys, fp32_model, tmp_path):
    """--vocab past the model's vocabulary failed in DrafterConfig after the answers were generated."""
    from draft_svc.heads import __main__ as command

    def answers(*args, **kwargs):
        raise AssertionError("the primary answered before --vocab was checked")

    monkeypatch.setattr(command, "resolve_model_dir", lambda *a, **k: tmp_path)
    monkeypatch.setattr(command, "load_model", lambda *a, **k: fp32_model)
    monkeypatch.setattr(command, "primary_answers", answers)
    vocab = fp32_model.config.vocab_size + 1
    with pytest.raises(SystemExit) as e:
        command.main(["train", "--out", str(tmp_path / "d.safetensors"), "--vocab", str(vocab)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--vocab {vocab}" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kept_by", ["another model", "a model of another width"])
def test_answers_data_of_another_model_is_refused(monkeypatch, capsys, fp32_model, tmp_path, kept_by):
    """--data kept by a run of another model trained a drafter bound to this model's fingerprint on the
    other's features; it is refused by its fingerprint (or, kept without one, its features' width)."""
    from draft_svc.heads import __main__ as command

    width = fp32_model.config.hidden_size if kept_by == "another model" else 64
    data = tmp_path / "answers.npz"
    np.savez(
        data, tokens=np.arange(5, dtype=np.int32), features=np.zeros((4, width), np.float16),
        argmax=np.zeros(4, np.int32), token_counts=np.array([5]), row_counts=np.array([4]), sources=np.array(["s"]),
        is_sampled=np.array([False]), prompt_keys=np.array([0]),
        **({"model_fingerprint": np.array("0" * 32)} if kept_by == "another model" else {}),
    )  # fmt: skip

    def train_drafter(*args, **kwargs):
        raise AssertionError("trained on another model's answers")

    monkeypatch.setattr(command, "resolve_model_dir", lambda *a, **k: tmp_path)
    monkeypatch.setattr(command, "load_model", lambda *a, **k: fp32_model)
    monkeypatch.setattr(command.Tokenizer, "from_dir", staticmethod(lambda *a, **k: None))
    monkeypatch.setattr(command, "train_drafter", train_drafter)
    with pytest.raises(SystemExit) as e:
        command.main(["train", "--out", str(tmp_path / "d.safetensors"), "--data", str(data)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and str(data) in err


def test_answers_data_round_trips_for_the_model_that_answered(tmp_path):
    from draft_svc.heads import generate

    seq = generate.Sequence_("s", True, np.arange(5, dtype=np.int32), np.ones((4, 8), np.float16), np.arange(4))
    generate.save_sequences(tmp_path / "a.npz", [seq, seq], "f" * 32)
    loaded = generate.load_sequences(tmp_path / "a.npz", "f" * 32, 8)
    assert len(loaded) == 2 and loaded[1].is_sampled and np.array_equal(loaded[1].tokens, seq.tokens)
    with pytest.raises(generate.AnswersDataError, match="0{32}"):
        generate.load_sequences(tmp_path / "a.npz", "0" * 32, 8)


@pytest.mark.parametrize("model", ["missing.gguf", "not-a.gguf"])
def test_a_model_the_command_cannot_read_is_one_line_not_a_traceback(monkeypatch, capsys, tmp_path, model):
    from draft_svc.heads import __main__ as command

    monkeypatch.setattr(command, "default_cache_dir", lambda: tmp_path / "cache")
    path = tmp_path / model
    if model == "not-a.gguf":
        path.write_bytes(b"PK\3\4" + bytes(60))
    with pytest.raises(SystemExit) as e:
        command.main(["answers", "--out", str(tmp_path / "a.safetensors"), "--model", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--model" in err and str(path) in err and len(err.strip().splitlines()) == 1
