"""VerifyArgs: the record a Verify carries, through its wire form and back, and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.errors import InvalidArgument, NotFound
from specdec.grammar.bitmask import TokenBitmask
from specdec.logprobs import LogprobsRequest
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2, logprobs_pb2, primary_pb2
from specdec.verify_args import VerifyArgs

VOCAB_SIZE = 40

ALLOWED = torch.zeros(3, VOCAB_SIZE, dtype=torch.bool)  # [N+1 = 3, V]
ALLOWED[0, [1, 2]] = ALLOWED[1, 7] = ALLOWED[2, [0, 39]] = True

STEP = VerifyArgs(
    "r",
    committed_token_ids=(4, 5, 6),
    accepted_nodes=(0, 1),
    tree_token_ids=(7, 8),
    tree_parents=(-1, 0),
    lookahead_token_ids=(9, 10, 11),
    lookahead_parents=(-1, 0, 1),
    logits_format="bf16",
    return_handle=True,
    allowed_tokens=TokenBitmask.from_bool(ALLOWED),
    kv_lease="lease",
    return_features=True,
    logprobs=LogprobsRequest(num_top=2),
    sampling=SamplingParams(frequency_penalty=0.5, logit_bias=((3, -1.0), (39, 2.0))),
)


def test_a_step_comes_back_as_sent() -> None:
    received = VerifyArgs.from_pb(STEP.to_pb(), VOCAB_SIZE)
    assert received.allowed_tokens is not None
    assert torch.equal(received.allowed_tokens.to_bool(), ALLOWED)
    # a TokenBitmask compares by identity: the rest of the record compares whole
    assert dataclasses.replace(received, allowed_tokens=None) == dataclasses.replace(STEP, allowed_tokens=None)


def test_unset_fields_read_as_none_or_empty() -> None:
    """No mask, logprobs or sampling on the wire: None (the primary then masks nothing, scores nothing
    and processes no row); an unspecified logits format is fp32."""
    assert VerifyArgs.from_pb(primary_pb2.VerifyRequest(request_id="r"), VOCAB_SIZE) == VerifyArgs("r")
    assert VerifyArgs.from_pb(VerifyArgs("r").to_pb(), VOCAB_SIZE) == VerifyArgs("r")


def test_num_rows_counts_the_root_and_the_tree_not_lookahead() -> None:
    assert STEP.num_rows == 3


def test_the_lease_is_checked_with_the_request_id_before_any_other_field() -> None:
    """A caller without the lease hears NOT_FOUND, as for an unknown request, whatever else is wrong."""
    seen = []

    def check_lease(request_id: str, kv_lease: str) -> None:
        seen.append((request_id, kv_lease))
        raise NotFound("request_id", f"no active request {request_id!r} on this primary")

    request = dataclasses.replace(STEP, tree_parents=(-1, 5)).to_pb()
    with pytest.raises(NotFound):
        VerifyArgs.from_pb(request, VOCAB_SIZE, check_lease=check_lease)
    assert seen == [("r", "lease")]


def test_a_bad_request_id_is_refused_before_the_lease_is_checked() -> None:
    def check_lease(request_id: str, kv_lease: str) -> None:
        raise AssertionError("the lease of an invalid request id was checked")

    with pytest.raises(InvalidArgument) as e:
        VerifyArgs.from_pb(primary_pb2.VerifyRequest(request_id=""), VOCAB_SIZE, check_lease=check_lease)
    assert e.value.field == "request_id"


def _mask(num_rows: int, bits: bytes | None = None) -> common_pb2.TokenMask:
    row_bytes = 8  # V = 40 tokens: two int32 words a row
    return common_pb2.TokenMask(num_rows=num_rows, bits=b"\x01" + bytes(row_bytes - 1) if bits is None else bits)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"tree": common_pb2.TokenTree(token_ids=[1], parents=[3])}, "tree.parents"),
        ({"tree": common_pb2.TokenTree(token_ids=[VOCAB_SIZE], parents=[-1])}, "tree.token_ids"),
        ({"lookahead": common_pb2.TokenTree(token_ids=[1, 2], parents=[-1, 5])}, "lookahead.parents"),
        ({"logits_format": 17}, "logits_format"),
        ({"allowed_tokens": _mask(2)}, "allowed_tokens.num_rows"),  # the root only: one row
        ({"allowed_tokens": _mask(1, bytes(7))}, "allowed_tokens.bits"),
        ({"logprobs": logprobs_pb2.LogprobsOptions(num_top_logprobs=21)}, "logprobs.num_top_logprobs"),
        ({"sampling": common_pb2.SamplingParams(logit_bias={VOCAB_SIZE: 1.0})}, "sampling.logit_bias"),
    ],
)
def test_a_bad_field_is_refused_by_name(fields: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        VerifyArgs.from_pb(primary_pb2.VerifyRequest(request_id="r", **fields), VOCAB_SIZE)
    assert e.value.field == field


def test_the_first_bad_field_in_the_primarys_order_is_the_one_named() -> None:
    """The tree, then lookahead, the logits format, the mask (whose rows are the tree's), logprobs,
    sampling: a request wrong in several is refused for the first of them."""
    request = primary_pb2.VerifyRequest(
        request_id="r",
        lookahead=common_pb2.TokenTree(token_ids=[1], parents=[4]),
        logits_format=17,
        allowed_tokens=_mask(5),
    )
    with pytest.raises(InvalidArgument) as e:
        VerifyArgs.from_pb(request, VOCAB_SIZE)
    assert e.value.field == "lookahead.parents"
