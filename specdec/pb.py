"""Protobuf <-> domain translation shared by the services (sampling, trees, logits).

Each conversion validates what a caller controls and raises InvalidArgument naming the
protobuf field, so every service refuses bad input the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from specdec.engine.tree import TreeError, check_tree
from specdec.errors import InvalidArgument, quoted
from specdec.features import DTYPES as FEATURE_DTYPES
from specdec.features import EncodedFeatures, decode_features
from specdec.logprobs import LogprobsRequest, TokenLogprob
from specdec.logits_codec import FORMAT_BF16, FORMAT_FP8_E4M3, FORMAT_FP32, EncodedLogits, decode_logits, encode_logits
from specdec.logits_shm import features_offset, read_features_slot, read_slot
from specdec.request_id import MAX_REQUEST_ID_CHARS as MAX_REQUEST_ID_CHARS  # the gateway reads it here
from specdec.request_id import check_request_id
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2, logprobs_pb2

LOGITS_FORMATS = {
    common_pb2.LOGITS_FORMAT_FP32: FORMAT_FP32,
    common_pb2.LOGITS_FORMAT_BF16: FORMAT_BF16,
    common_pb2.LOGITS_FORMAT_FP8_E4M3: FORMAT_FP8_E4M3,
}
LOGITS_FORMAT_ENUMS = {v: k for k, v in LOGITS_FORMATS.items()}


# The most engine steps one DecodeStream message may carry (DecodeRequest.steps_per_message).
MAX_STEPS_PER_MESSAGE = 256


def steps_per_message_from_pb(value: int, field: str = "steps_per_message") -> int:
    """DecodeRequest.steps_per_message as the steps a message carries at most (0 and 1: one)."""
    if value > MAX_STEPS_PER_MESSAGE:
        raise InvalidArgument(field, f"must be at most {MAX_STEPS_PER_MESSAGE}, got {value}")
    return max(1, value)


def request_id_from_pb(request_id: str, field: str = "request_id") -> str:
    return check_request_id(request_id, field)


def sampling_from_pb(pb: common_pb2.SamplingParams, field: str = "sampling") -> SamplingParams:
    try:
        return SamplingParams(
            temperature=float(pb.temperature),
            top_k=int(pb.top_k),
            top_p=float(pb.top_p) if pb.HasField("top_p") else 1.0,
            seed=int(pb.seed) if pb.HasField("seed") else None,
            frequency_penalty=float(pb.frequency_penalty),
            presence_penalty=float(pb.presence_penalty),
            repetition_penalty=float(pb.repetition_penalty) if pb.HasField("repetition_penalty") else 1.0,
            min_p=float(pb.min_p),
            logit_bias=_logit_bias_from_pb(pb, field),
            min_tokens=int(pb.min_tokens),
            min_tokens_ids=tuple(sorted(set(pb.min_tokens_ids))),
        )
    except ValueError as e:  # "top_p must be ...": the field's name, then what is wrong with it
        name, _, problem = str(e).partition(" ")
        name = name.split("[", 1)[0]  # "logit_bias[7]" names the field logit_bias
        raise InvalidArgument(f"{field}.{name}", problem) from None


def _logit_bias_from_pb(pb: common_pb2.SamplingParams, field: str) -> tuple[tuple[int, float], ...]:
    """The map, sorted by token id (a map's order on the wire is not defined); negative ids refused."""
    for token_id in pb.logit_bias:
        if token_id < 0:
            raise InvalidArgument(f"{field}.logit_bias", f"token ids must be >= 0, got {token_id}")
    return tuple(sorted((int(t), float(b)) for t, b in pb.logit_bias.items()))


def check_sampling_token_ids(params: SamplingParams, vocab_size: int, field: str = "sampling") -> None:
    """The token ids of logit_bias and min_tokens_ids are below vocab_size (SamplingParams cannot know
    the vocabulary)."""
    if params.logit_bias and params.logit_bias[-1][0] >= vocab_size:
        raise InvalidArgument(
            f"{field}.logit_bias", f"token id {params.logit_bias[-1][0]} is not below the vocab_size {vocab_size}"
        )
    if params.min_tokens_ids and params.min_tokens_ids[-1] >= vocab_size:
        raise InvalidArgument(
            f"{field}.min_tokens_ids", f"token id {params.min_tokens_ids[-1]} is not below the vocab_size {vocab_size}"
        )


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        min_p=params.min_p,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
        min_tokens_ids=params.min_tokens_ids,
    )
    if params.seed is not None:
        pb.seed = params.seed
    if params.repetition_penalty != 1.0:
        pb.repetition_penalty = params.repetition_penalty
    return pb


def tree_from_pb(
    pb: common_pb2.TokenTree, vocab_size: int, field: str = "tree", *, is_siblings_unique: bool = False
) -> tuple[list[int], list[int]]:
    """The checked tree (check_tree; with is_siblings_unique, a merged one), InvalidArgument naming
    `field`.token_ids or `field`.parents."""
    token_ids, parents = list(pb.token_ids), list(pb.parents)
    try:
        check_tree(token_ids, parents, vocab_size, is_siblings_unique=is_siblings_unique)
    except TreeError as e:
        raise InvalidArgument(f"{field}.{e.field}", str(e)) from None
    return token_ids, parents


def logits_format_from_pb(value: common_pb2.LogitsFormat, field: str = "logits_format") -> str:
    if value == common_pb2.LOGITS_FORMAT_UNSPECIFIED:
        return FORMAT_FP32
    if value not in LOGITS_FORMATS:
        raise InvalidArgument(field, f"unknown logits format {value}")
    return LOGITS_FORMATS[value]


def logits_to_pb(logits: torch.Tensor, fmt: str) -> common_pb2.Logits:
    """fp32 logits [R, V] -> inline Logits in `fmt`."""
    enc = encode_logits(logits, fmt)
    inline = common_pb2.InlineLogits(
        format=LOGITS_FORMAT_ENUMS[enc.format],
        num_rows=enc.num_rows,
        vocab_size=enc.vocab_size,
        data=enc.data,
        row_scales=enc.row_scales or (),
    )
    return common_pb2.Logits(inline_logits=inline)


def logits_handle_to_pb(segment_name: str, enc: EncodedLogits, instance_id: str) -> common_pb2.Logits:
    """Logits written to a shared-memory slot (specdec.logits_shm) -> a handle to them."""
    memory = common_pb2.MemoryHandle(
        kind=common_pb2.HANDLE_KIND_SHARED_MEMORY,
        segment_name=segment_name,
        device_index=-1,
        num_bytes=len(enc.data),
        owner_instance_id=instance_id,
    )
    return common_pb2.Logits(
        handle=common_pb2.LogitsHandle(
            memory=memory,
            format=LOGITS_FORMAT_ENUMS[enc.format],
            num_rows=enc.num_rows,
            vocab_size=enc.vocab_size,
            row_scales=enc.row_scales or (),
        )
    )


def logits_from_pb(pb: common_pb2.Logits, field: str) -> torch.Tensor:
    """Inline Logits, or a handle to a shared-memory slot on this machine -> fp32 [R, V]."""
    return decode_logits(encoded_logits_from_pb(pb, field))


def encoded_logits_from_pb(pb: common_pb2.Logits, field: str) -> EncodedLogits:
    """Inline Logits, or a handle to a shared-memory slot on this machine -> the checked wire bytes,
    not decoded (the validator's CUDA path reads fp8 / bf16 / fp32 bytes as they came)."""
    if pb.HasField("handle"):
        h = pb.handle
        if h.memory.kind != common_pb2.HANDLE_KIND_SHARED_MEMORY:
            raise InvalidArgument(f"{field}.handle.memory.kind", "only shared-memory logits handles are served here")
        fmt = logits_format_from_pb(h.format, f"{field}.handle.format")
        scales = tuple(h.row_scales) if fmt == FORMAT_FP8_E4M3 else None
        return read_slot(
            h.memory.segment_name, h.memory.num_bytes, fmt, h.num_rows, h.vocab_size, scales, f"{field}.handle"
        )
    if not pb.HasField("inline_logits"):
        raise InvalidArgument(field, "expected inline logits or a handle")
    inline = pb.inline_logits
    fmt = logits_format_from_pb(inline.format, f"{field}.inline_logits.format")
    try:
        return EncodedLogits(
            fmt,
            inline.num_rows,
            inline.vocab_size,
            inline.data,
            tuple(inline.row_scales) if fmt == FORMAT_FP8_E4M3 else None,
        )
    except ValueError as e:
        raise InvalidArgument(f"{field}.inline_logits", str(e)) from None


def features_to_pb(enc: EncodedFeatures) -> common_pb2.Features:
    """Features inline (every row)."""
    return common_pb2.Features(dtype=enc.dtype, num_rows=enc.num_rows, hidden_size=enc.hidden_size, data=enc.data)


def features_handle_to_pb(
    segment_name: str, enc: EncodedFeatures, num_logits_bytes: int, instance_id: str
) -> common_pb2.Features:
    """Features a verify wrote after its logits (num_logits_bytes) in a slot (specdec.logits_shm)."""
    memory = common_pb2.MemoryHandle(
        kind=common_pb2.HANDLE_KIND_SHARED_MEMORY,
        segment_name=segment_name,
        device_index=-1,
        offset=features_offset(num_logits_bytes),
        num_bytes=enc.num_bytes,
        owner_instance_id=instance_id,
    )
    return common_pb2.Features(dtype=enc.dtype, num_rows=enc.num_rows, hidden_size=enc.hidden_size, memory=memory)


def select_feature_rows(pb: common_pb2.Features, rows: Sequence[int]) -> common_pb2.Features:
    """The rows `rows` (of the rows `pb` names) of features: inline ones sliced, a handle forwarded
    with its rows field naming them (the reader takes them from shared memory)."""
    meant = list(pb.rows) or range(pb.num_rows)
    chosen = [meant[r] for r in rows]
    if pb.HasField("memory"):
        out = common_pb2.Features()
        out.CopyFrom(pb)
        out.ClearField("rows")
        out.rows.extend(chosen)
        return out
    return features_to_pb(encoded_features_from_pb(pb, "features").rows(chosen))


def encoded_features_from_pb(pb: common_pb2.Features, field: str) -> EncodedFeatures:
    """Features inline, or a handle into a logits slot on this machine -> every payload row, checked."""
    if pb.dtype not in FEATURE_DTYPES:
        raise InvalidArgument(f"{field}.dtype", f"must be one of {FEATURE_DTYPES}, got {quoted(pb.dtype)}")
    if pb.num_rows < 1 or pb.hidden_size < 1:
        raise InvalidArgument(field, f"num_rows and hidden_size must be >= 1, got [{pb.num_rows}, {pb.hidden_size}]")
    if pb.HasField("memory"):
        m = pb.memory
        if m.kind != common_pb2.HANDLE_KIND_SHARED_MEMORY:
            raise InvalidArgument(f"{field}.memory.kind", "only shared-memory features handles are served here")
        return read_features_slot(m.segment_name, m.offset, m.num_bytes, pb.dtype, pb.num_rows, pb.hidden_size, field)
    if not pb.HasField("data"):
        raise InvalidArgument(field, "expected inline data or a memory handle")
    try:
        return EncodedFeatures(pb.dtype, pb.num_rows, pb.hidden_size, pb.data)
    except ValueError as e:
        raise InvalidArgument(f"{field}.data", str(e)) from None


def features_from_pb(pb: common_pb2.Features, field: str = "features") -> np.ndarray:
    """Features (inline or a handle) -> float32 [n, C] of the rows pb.rows names (all when empty)."""
    enc = encoded_features_from_pb(pb, field)
    rows = list(pb.rows)
    # A row index is a byte on the wire, a decoded row hidden_size floats: rows naming a row over and
    # over would decode a message of a few MB to GBs. A reader means each row once.
    if len(rows) > enc.num_rows:
        raise InvalidArgument(f"{field}.rows", f"names {len(rows)} rows, more than the num_rows {enc.num_rows}")
    if any(r >= enc.num_rows for r in rows):
        raise InvalidArgument(f"{field}.rows", f"rows {rows} must be below num_rows {enc.num_rows}")
    values = decode_features(enc)  # [R, C]
    return values[rows] if rows else values


def token_mask_row_bytes(vocab_size: int) -> int:
    """Bytes of one TokenMask row: whole 32-bit words, as the grammar engine packs them."""
    return (vocab_size + 31) // 32 * 4


def token_mask_to_pb(mask) -> common_pb2.TokenMask:
    """specdec.grammar.TokenBitmask -> TokenMask: its words are the wire layout, copied as they are."""
    return common_pb2.TokenMask(num_rows=mask.num_rows, bits=mask.to_bytes())


def token_mask_from_pb(pb: common_pb2.TokenMask, num_rows: int, vocab_size: int, field: str):
    """TokenMask -> specdec.grammar.TokenBitmask [num_rows] over the wire bytes (no copy, never unpacked);
    refuses a wrong shape, set padding bits, or a row that allows no token (it would leave no token to
    choose). The checks read the packed words: O(rows x words), not rows x vocabulary."""
    from specdec.grammar.bitmask import TokenBitmask  # the grammar engine loads only where it is used

    row_bytes = token_mask_row_bytes(vocab_size)
    if pb.num_rows != num_rows:
        raise InvalidArgument(f"{field}.num_rows", f"is {pb.num_rows}, expected {num_rows}")
    if len(pb.bits) != num_rows * row_bytes:
        raise InvalidArgument(f"{field}.bits", f"has {len(pb.bits)} bytes, expected {num_rows} rows of {row_bytes}")
    words = np.frombuffer(pb.bits, dtype="<i4").reshape(num_rows, row_bytes // 4)  # [R, W]
    if num_rows and not words.any(axis=1).all():
        raise InvalidArgument(f"{field}.bits", "a row allows no token")
    num_padding_bits = row_bytes * 8 - vocab_size  # in the last word, above token V - 1
    if num_rows and num_padding_bits and (words[:, -1] >> (32 - num_padding_bits)).any():
        raise InvalidArgument(f"{field}.bits", f"allows a token id >= the vocabulary size {vocab_size}")
    return TokenBitmask(words, vocab_size)


RESPONSE_FORMAT_TYPES = {
    "json_object": common_pb2.ResponseFormat.TYPE_JSON_OBJECT,
    "json_schema": common_pb2.ResponseFormat.TYPE_JSON_SCHEMA,
}


def response_format_to_pb(response_format) -> common_pb2.ResponseFormat:
    """specdec.grammar.ResponseFormat -> ResponseFormat (kind json_object or json_schema)."""
    return common_pb2.ResponseFormat(
        type=RESPONSE_FORMAT_TYPES[response_format.kind], json_schema=response_format.schema_text or ""
    )


def response_format_from_pb(pb: common_pb2.ResponseFormat):
    """ResponseFormat -> specdec.grammar.ResponseFormat, or None for free text (unset or TYPE_TEXT).
    Raises InvalidArgument naming response_format.type / .json_schema."""
    from specdec.grammar.compiler import ResponseFormat  # the grammar engine loads only where it is used

    kinds = {v: k for k, v in RESPONSE_FORMAT_TYPES.items()}
    if pb.type in (common_pb2.ResponseFormat.TYPE_UNSPECIFIED, common_pb2.ResponseFormat.TYPE_TEXT):
        if pb.json_schema:
            raise InvalidArgument(
                "response_format.json_schema", "must be empty unless response_format.type is TYPE_JSON_SCHEMA"
            )
        return None
    if pb.type not in kinds:
        raise InvalidArgument("response_format.type", f"unknown response format type {pb.type}")
    return ResponseFormat(kinds[pb.type], pb.json_schema or None)


def logprobs_request_from_pb(options: logprobs_pb2.LogprobsOptions) -> LogprobsRequest:
    """The checked request (InvalidArgument naming the field when out of range)."""
    return LogprobsRequest(options.num_top_logprobs, options.include_prompt)


def logprobs_request_to_pb(request: LogprobsRequest) -> logprobs_pb2.LogprobsOptions:
    return logprobs_pb2.LogprobsOptions(num_top_logprobs=request.num_top, include_prompt=request.is_prompt_included)


def token_logprob_to_pb(
    value: TokenLogprob,
    decode: Callable[[int], str] | None = None,
    token_bytes: Callable[[int], bytes] | None = None,
) -> logprobs_pb2.TokenLogprob:
    """`decode`: token id -> its text, `token_bytes`: token id -> its own bytes (the gateway's
    answers carry both), or None."""

    def top(t: int, p: float) -> logprobs_pb2.TopLogprob:
        return logprobs_pb2.TopLogprob(
            token_id=t,
            logprob=p,
            text="" if decode is None else decode(t),
            token_bytes=b"" if token_bytes is None else token_bytes(t),
        )

    return logprobs_pb2.TokenLogprob(
        token_id=value.token_id,
        logprob=value.logprob,
        top_logprobs=[top(t, p) for t, p in value.top],
        text="" if decode is None else decode(value.token_id),
        token_bytes=b"" if token_bytes is None else token_bytes(value.token_id),
    )


def token_logprob_from_pb(value: logprobs_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(value.token_id, value.logprob, tuple((t.token_id, t.logprob) for t in value.top_logprobs))
