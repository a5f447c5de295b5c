"""The validation path: chosen once at start-up, logged and exported; the CUDA path validates through
the kernel on the wire's bytes and answers what the torch path answers, through the servicer."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from specdec import pb
from specdec.acceptance_mode import AcceptanceMode
from specdec.errors import InvalidArgument
from specdec.grammar.bitmask import TokenBitmask
from specdec.logits_codec import FORMATS, EncodedLogits
from specdec.sampling import SamplingParams
from specdec.service.server import ServerConfig
from specdec.speculation_bounds import MAX_TREE_NODES
from specdec.v1 import validator_pb2
from tests.validator_svc.cuda import requires_cuda_kernel
from tests.validator_svc.requests import validate_request
from validator_svc import paths
from validator_svc.__main__ import build_servicer
from validator_svc.config import ValidatorConfig
from validator_svc.kernel import CudaRowStats, row_stats_cpu
from validator_svc.paths import PATH_CUDA, PATH_TORCH, CudaPath, TorchPath, make_path
from validator_svc.server import ValidatorServicer

GREEDY, SAMPLE, THRESHOLD = (
    validator_pb2.ACCEPTANCE_MODE_GREEDY,
    validator_pb2.ACCEPTANCE_MODE_SAMPLE,
    validator_pb2.ACCEPTANCE_MODE_THRESHOLD,
)


def no_device() -> int:
    return 0


def one_device() -> int:
    return 1


def test_make_path_follows_the_device():
    assert isinstance(make_path("cpu", device_count=one_device), TorchPath)
    assert isinstance(make_path("auto", device_count=no_device), TorchPath)
    assert isinstance(make_path("auto", device_count=one_device), CudaPath)
    assert isinstance(make_path("cuda", device_count=one_device), CudaPath)
    with pytest.raises(ValueError, match="no CUDA device"):
        make_path("cuda", device_count=no_device)  # refused at start-up, not on the first request
    with pytest.raises(ValueError, match="device"):
        make_path("tpu")


@pytest.mark.parametrize(
    "device, device_count, expected",
    [("auto", no_device, PATH_TORCH), ("auto", one_device, PATH_CUDA), ("cpu", one_device, PATH_TORCH)],
)
def test_the_servicer_runs_the_chosen_path_and_exports_it(fake_cupy, device, device_count, expected):
    registry = CollectorRegistry()
    servicer = build_servicer(ValidatorConfig(ServerConfig(port=0), device=device), registry, device_count=device_count)
    assert servicer.path.name == expected
    assert registry.get_sample_value("specdec_validation_path", {"path": expected}) == 1.0
    token_ids, parents, logits = [2, 0], [-1, 0], torch.tensor([[0.0, 1.0, 5.0], [4.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    response = servicer.Validate(validate_request(logits, token_ids, parents, "bf16"), None)
    assert list(response.accepted_nodes) == [0, 1] and response.bonus_token == 1
    assert fake_cupy.launches == (1 if expected == PATH_CUDA else 0)  # the kernel runs on the cuda path only


def test_the_cuda_path_reads_the_wire_bytes_and_never_decodes_on_the_host(monkeypatch):
    calls = []

    def spy_row_stats(encoded, token_ids, parents, allowed):
        calls.append((encoded, allowed))
        return row_stats_cpu(encoded, token_ids, parents, allowed)

    def no_host_decode(encoded):
        raise AssertionError("the cuda path decoded the logits on the host")

    monkeypatch.setattr(paths, "decode_logits", no_host_decode)
    logits = torch.tensor([[0.0, 1.0, 5.0], [4.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    allowed = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    servicer = ValidatorServicer(CudaPath(row_stats=spy_row_stats))
    response = servicer.Validate(validate_request(logits, [2, 0], [-1, 0], "fp8_e4m3", allowed=allowed), None)
    ((encoded, mask),) = calls
    assert isinstance(encoded, EncodedLogits) and encoded.format == "fp8_e4m3"
    assert isinstance(mask, TokenBitmask)  # packed, as it came
    assert list(response.accepted_nodes) == [] and response.bonus_token == 1  # token 2 is forbidden at the root


def test_sampled_modes_go_to_the_host_path():
    def no_kernel(*args):
        raise AssertionError("the kernel cannot decide a sampled mode")

    logits = torch.tensor([[0.0, 1.0, 5.0], [4.0, 0.0, 0.0]])
    cuda = ValidatorServicer(CudaPath(row_stats=no_kernel))
    for mode, threshold in ((SAMPLE, 0.0), (THRESHOLD, 0.5)):
        # min_p, like top-k / top-p, shapes whole rows after temperature: the host reference's work
        for sampling in (SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0.7, seed=3, min_p=0.3)):
            req = validate_request(logits, [2], [-1], "fp32", mode=mode, sampling=sampling)
            req.acceptance_threshold = threshold
            got, expected = cuda.Validate(req, None), ValidatorServicer(TorchPath()).Validate(req, None)
            got.ClearField("time_ms")
            expected.ClearField("time_ms")
            assert got == expected


class RecordingPath(TorchPath):
    """The torch path, keeping the inputs the servicer handed it."""

    def __init__(self) -> None:
        self.inputs: list[paths.ValidationInputs] = []

    def validate(self, inputs):
        self.inputs.append(inputs)
        return super().validate(inputs)


def test_the_mode_sent_is_the_mode_applied():
    logits = torch.tensor([[0.0, 1.0, 5.0], [4.0, 0.0, 0.0]])
    path = RecordingPath()
    ValidatorServicer(path).Validate(validate_request(logits, [2], [-1], "fp32", mode=SAMPLE), None)  # at temperature 0
    assert path.inputs[-1].mode == AcceptanceMode.SAMPLE


@pytest.mark.parametrize(
    "mode, temperature, threshold, field",
    [
        (validator_pb2.ACCEPTANCE_MODE_UNSPECIFIED, 0.0, 0.0, "mode"),  # the caller decides, always
        (99, 0.0, 0.0, "mode"),
        (GREEDY, 0.7, 0.0, "mode"),
        (GREEDY, 0.0, 0.5, "acceptance_threshold"),
        (THRESHOLD, 0.0, 0.0, "acceptance_threshold"),
        (THRESHOLD, 0.0, 1.5, "acceptance_threshold"),
    ],
)
def test_a_mode_that_does_not_fit_the_step_is_refused_naming_the_field(mode, temperature, threshold, field):
    req = validate_request(
        torch.zeros(2, 3), [2], [-1], "fp32", mode=mode, sampling=SamplingParams(temperature=temperature)
    )
    req.acceptance_threshold = threshold
    with pytest.raises(InvalidArgument) as e:
        ValidatorServicer().Validate(req, None)
    assert e.value.field == field


@pytest.mark.parametrize("fmt", ["fp32", "fp8_e4m3"])
@pytest.mark.parametrize("argmax", [[2], [2, 0, 1], [2, 3], [-1, 0]])
@pytest.mark.parametrize("is_masked", [False, True])
def test_a_primary_argmax_of_the_wrong_length_or_range_is_refused_naming_its_field(fmt, argmax, is_masked):
    # The rule calls them argmax_ids; the caller sent target_argmax_token_ids, and the refusal names that.
    logits = torch.tensor([[0.0, 1.0, 5.0], [4.0, 0.0, 0.0]])
    allowed = torch.ones(2, 3, dtype=torch.bool) if is_masked else None
    req = validate_request(logits, [2], [-1], fmt, allowed=allowed, argmax=argmax)
    with pytest.raises(InvalidArgument) as e:
        ValidatorServicer().Validate(req, None)
    assert e.value.field == "target_argmax_token_ids"


@pytest.mark.parametrize("fmt", ["fp32", "fp8_e4m3"])
def test_siblings_with_the_same_token_are_refused_naming_the_tree_field(fmt):
    # The rule refused them as "token_ids[1]", which is no field of the request.
    req = validate_request(torch.zeros(3, 3), [1, 1], [-1, -1], fmt)
    with pytest.raises(InvalidArgument) as e:
        ValidatorServicer().Validate(req, None)
    assert e.value.field == "tree.token_ids" and "sibling" in str(e.value)


def test_a_tree_past_the_structural_node_bound_is_refused_before_the_rule_runs():
    # The primary verifies at most MAX_TREE_NODES nodes; a larger tree (cheap to send at a small
    # vocabulary: 200k nodes in a few MB) held a validator thread for seconds.
    path = RecordingPath()
    chain = list(range(-1, MAX_TREE_NODES))  # MAX_TREE_NODES + 1 nodes
    req = validate_request(torch.zeros(len(chain) + 1, 2), [0] * len(chain), chain, "fp32")
    with pytest.raises(InvalidArgument) as e:
        ValidatorServicer(path).Validate(req, None)
    assert e.value.field == "tree.token_ids" and not path.inputs
    at_bound = validate_request(torch.zeros(len(chain), 2), [0] * (len(chain) - 1), chain[:-1], "fp32")
    ValidatorServicer(path).Validate(at_bound, None)
    assert len(path.inputs[-1].token_ids) == MAX_TREE_NODES


@pytest.mark.parametrize("name", ["token_ids", "parents"])
def test_a_tree_past_the_node_bound_is_refused_before_it_or_the_logits_are_read(monkeypatch, name):
    # Checking a tree of millions of nodes (and its set of siblings) took seconds and hundreds of MB
    # before its size was looked at; the fields' lengths decide first.
    def no_read(*args, **kwargs):
        raise AssertionError("the oversized tree was read")

    monkeypatch.setattr(pb, "check_tree", no_read)
    monkeypatch.setattr(pb, "encoded_logits_from_pb", no_read)
    req = validate_request(torch.zeros(2, 2), [0], [-1], "fp32")
    getattr(req.tree, name).extend([0] * MAX_TREE_NODES)  # MAX_TREE_NODES + 1 entries
    with pytest.raises(InvalidArgument) as e:
        ValidatorServicer().Validate(req, None)
    assert e.value.field == f"tree.{name}"


# ---- the two paths agree through the servicer: an emulated kernel here, the real one on a GPU -------


def parity_requests(random_tree_logits, fmt: str, vocab_size: int):
    """Greedy and temperature-0 threshold steps, with and without a grammar mask and the primary's argmax,
    and with a min_p (the kernel's greedy statistics ignore it, as the reference does: the most likely
    token always passes min_p, and greedy decoding keeps only that one)."""
    for seed in range(3):
        token_ids, parents, logits = random_tree_logits(8, vocab_size, seed)
        generator = torch.Generator().manual_seed(seed)
        allowed = torch.rand(9, vocab_size, generator=generator) < 0.7  # [N+1, V]
        allowed[:, 0] = True
        for j, (token, parent) in enumerate(zip(token_ids, parents)):
            allowed[parent + 1, token] = j != 1  # node 1 is off the grammar
        masked_argmax = torch.where(allowed, logits, float("-inf")).argmax(dim=-1).tolist()
        for mask, argmax in (
            (None, None),
            (None, logits.argmax(dim=-1).tolist()),
            (allowed, None),
            (allowed, masked_argmax),
        ):
            yield validate_request(logits, token_ids, parents, fmt, allowed=mask, argmax=argmax)
            req = validate_request(logits, token_ids, parents, fmt, mode=THRESHOLD, allowed=mask)
            req.acceptance_threshold = 0.3
            yield req
            yield validate_request(logits, token_ids, parents, fmt, sampling=SamplingParams(min_p=0.9), allowed=mask)


def assert_paths_agree(cuda_path, random_tree_logits, fmt: str, vocab_size: int) -> None:
    cuda, host = ValidatorServicer(cuda_path), ValidatorServicer(TorchPath())
    for req in parity_requests(random_tree_logits, fmt, vocab_size):
        got, expected = cuda.Validate(req, None), host.Validate(req, None)
        assert (list(got.accepted_nodes), got.bonus_token) == (list(expected.accepted_nodes), expected.bonus_token)
        assert list(got.accepted_entropies) == pytest.approx(list(expected.accepted_entropies), rel=1e-4, abs=1e-4)
        assert list(got.rejected_entropies) == pytest.approx(list(expected.rejected_entropies), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_path_with_an_emulated_kernel_agrees_with_torch(fake_cupy, random_tree_logits, fmt):
    assert_paths_agree(CudaPath(CudaRowStats()), random_tree_logits, fmt, vocab_size=70)
    assert fake_cupy.launches > 0


@pytest.mark.gpu
@requires_cuda_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("vocab_size", [70, 49152])
def test_gpu_service_path_agrees_with_torch(random_tree_logits, fmt, vocab_size):
    path = make_path("cuda")
    path.warm_up()
    assert_paths_agree(path, random_tree_logits, fmt, vocab_size)
