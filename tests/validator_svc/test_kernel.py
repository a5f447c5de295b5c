"""Row statistics: the torch reference (hand cases), the host walk, the CUDA source and GPU parity."""

from __future__ import annotations

import math
import shutil
import subprocess

import pytest
import torch

from specdec.grammar.bitmask import TokenBitmask
from specdec.logits_codec import FORMATS, EncodedLogits, decode_logits, encode_logits
from specdec.sampling import SamplingParams
from tests.validator_svc.cuda import requires_cuda_kernel
from validator_svc.acceptance import greedy_accept, threshold_accept
from validator_svc.kernel import (
    KERNEL_NAME,
    ROW_STATS_SOURCE,
    CudaRowStats,
    _csr,
    row_stats_cpu,
    row_stats_reference,
    validate_from_stats,
)

NEG = -math.inf
TOKEN_IDS, PARENTS = [2, 0, 3, 1], [-1, 0, -1, 2]  # root ── 0:2 ── 1:0 ;  root ── 2:3 ── 3:1
requires_gpu = requires_cuda_kernel


def test_reference_hand_case():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform: max 0, lse ln 4, entropy ln 4, argmax 0 (lowest of ties)
            [1.0, NEG, 1.0, NEG],  # two tokens: lse 1 + ln 2, entropy ln 2, argmax 0
            [0.0, 0.0, 0.0, 5.0],
            [0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    stats = row_stats_reference(logits, TOKEN_IDS, PARENTS)
    assert stats.argmax_ids.tolist() == [0, 0, 3, 0, 0]
    torch.testing.assert_close(stats.log_normalizer[:2], torch.tensor([math.log(4), 1 + math.log(2)]))
    torch.testing.assert_close(stats.entropy[:2], torch.tensor([math.log(4), math.log(2)]))
    # Node 0 (tok 2) and node 2 (tok 3) sit in row 0 (p = 1/4 each); node 1 (tok 0) in row 1 (p = 1/2);
    # node 3 (tok 1) in row 3 (p = 1/4).
    torch.testing.assert_close(stats.child_probs, torch.tensor([0.25, 0.5, 0.25, 0.25]))
    assert stats.child_logits.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_csr_worked_example():
    assert _csr(((0, 2), (1,), (), ()), [7, 8, 9]) == ([0, 2, 3, 3, 3], [0, 2, 1], [7, 9, 8])


@pytest.mark.parametrize("fmt", FORMATS)
def test_host_walk_on_stats_equals_the_reference_rule(fmt, random_tree_logits):
    for seed in range(6):
        token_ids, parents, logits = random_tree_logits(8, 64, seed)
        decoded = decode_logits(encode_logits(logits, fmt))
        stats = row_stats_cpu(encode_logits(logits, fmt), token_ids, parents)
        assert validate_from_stats(stats, token_ids, parents) == greedy_accept(token_ids, parents, decoded)
        for threshold in (0.05, 0.5):
            assert validate_from_stats(stats, token_ids, parents, acceptance_threshold=threshold) == threshold_accept(
                token_ids, parents, decoded, SamplingParams(), threshold, None
            )
        argmax_ids = logits.argmax(dim=-1).tolist()
        assert validate_from_stats(stats, token_ids, parents, argmax_ids=argmax_ids) == greedy_accept(
            token_ids, parents, decoded, argmax_ids=argmax_ids
        )


def test_invalid_rows_are_rejected_after_the_stats():
    encoded = encode_logits(torch.zeros(2, 4), "fp8_e4m3")
    nan_row = EncodedLogits("fp8_e4m3", 2, 4, b"\x00\x00\x00\x00\x7f\x00\x00\x00", encoded.row_scales)  # 0x7f is NaN
    with pytest.raises(ValueError, match="target_logits row 1"):
        validate_from_stats(row_stats_cpu(nan_row, [1], [-1]), [1], [-1])
    with pytest.raises(ValueError, match="target_logits row 0"):
        validate_from_stats(row_stats_reference(torch.tensor([[NEG, NEG], [0.0, 0.0]]), [1], [-1]), [1], [-1])
    with pytest.raises(ValueError, match=r"token_ids\[0\]"):
        row_stats_cpu(encoded, [4], [-1])


def test_construction_compiles_nothing():
    CudaRowStats()  # constructing needs no GPU; the service compiles at start-up (paths.CudaPath.warm_up)
    with pytest.raises(ValueError, match="threads_per_block"):
        CudaRowStats(threads_per_block=48)


def random_mask(num_rows: int, vocab_size: int, token_ids, parents, seed: int) -> TokenBitmask:
    """Allows about half the vocabulary in each row, and always forbids the first child of the root
    (so a walk meets a forbidden draft token) while allowing the other nodes' tokens."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(num_rows, vocab_size, generator=generator) < 0.5  # [R, V]
    allowed[:, 0] = True  # never an empty row
    for j, (token, parent) in enumerate(zip(token_ids, parents)):
        allowed[parent + 1, token] = j != 0
    return TokenBitmask.from_bool(allowed)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_stats_under_a_mask_equal_the_masked_rule(fmt, random_tree_logits):
    """The stats of masked rows decide exactly what greedy / threshold acceptance with `allowed` decide."""
    for seed in range(4):
        token_ids, parents, logits = random_tree_logits(8, 70, seed)  # 70: the last word is partial
        allowed = random_mask(9, 70, token_ids, parents, seed)
        encoded = encode_logits(logits, fmt)
        decoded = decode_logits(encoded)
        stats = row_stats_cpu(encoded, token_ids, parents, allowed)
        assert float(stats.child_probs[0]) == 0.0 and stats.child_logits[0] == -math.inf  # node 0 is forbidden
        assert validate_from_stats(stats, token_ids, parents) == greedy_accept(
            token_ids, parents, decoded, allowed=allowed
        )
        for threshold in (0.05, 0.5):
            assert validate_from_stats(stats, token_ids, parents, acceptance_threshold=threshold) == threshold_accept(
                token_ids, parents, decoded, SamplingParams(), threshold, None, allowed=allowed
            )


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_source_compiles_for_sm90(tmp_path):
    source = tmp_path / "row_stats.cu"
    source.write_text(ROW_STATS_SOURCE)
    ptx = tmp_path / "row_stats.ptx"
    completed = subprocess.run(
        ["nvcc", "-arch=sm_90", "--ptx", str(source), "-o", str(ptx)], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert f".entry {KERNEL_NAME}(" in ptx.read_text()


# ---- GPU parity (skipped without a device) -----------------------------------------------------


def assert_stats_match(gpu, cpu) -> None:
    assert torch.equal(gpu.argmax_ids, cpu.argmax_ids)
    assert torch.equal(gpu.row_max, cpu.row_max)
    assert torch.equal(gpu.child_logits, cpu.child_logits)  # exact decode in both
    torch.testing.assert_close(gpu.log_normalizer, cpu.log_normalizer, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpu.entropy, cpu.entropy, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu.child_probs, cpu.child_probs, rtol=1e-4, atol=1e-7)


def assert_same_decision(gpu, cpu) -> None:
    """The same accepted nodes and bonus token; the entropies, sums over the vocabulary taken in
    another order on the device, within float rounding."""
    assert (gpu.accepted_nodes, gpu.bonus_token) == (cpu.accepted_nodes, cpu.bonus_token)
    assert gpu.accepted_entropies == pytest.approx(cpu.accepted_entropies, rel=1e-5, abs=1e-5)
    assert gpu.rejected_entropies == pytest.approx(cpu.rejected_entropies, rel=1e-5, abs=1e-5)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("vocab_size", [1, 33, 49152, 151936])
def test_gpu_stats_equal_the_reference(fmt, vocab_size, random_tree_logits):
    kernel = CudaRowStats()
    num_nodes = 8 if vocab_size >= 4 else 0
    token_ids, parents, logits = random_tree_logits(num_nodes, vocab_size, seed=vocab_size)
    if vocab_size >= 33:
        logits[1, [3, 17, 30]] = logits[1].max() + 1.0  # a three-way tie for the argmax
    if vocab_size >= 33 and fmt != "fp8_e4m3":
        logits[2, :10] = NEG  # masked tokens
    encoded = encode_logits(logits, fmt)
    gpu, cpu = kernel(encoded, token_ids, parents), row_stats_cpu(encoded, token_ids, parents)
    assert_stats_match(gpu, cpu)
    if vocab_size >= 33:
        assert int(gpu.argmax_ids[1]) == 3
    for threshold in (0.0, 0.3):
        assert_same_decision(
            validate_from_stats(gpu, token_ids, parents, acceptance_threshold=threshold),
            validate_from_stats(cpu, token_ids, parents, acceptance_threshold=threshold),
        )
    if num_nodes:  # the packed grammar mask, bits tested in the kernel
        allowed = random_mask(num_nodes + 1, vocab_size, token_ids, parents, seed=vocab_size)
        assert_stats_match(
            kernel(encoded, token_ids, parents, allowed), row_stats_cpu(encoded, token_ids, parents, allowed)
        )


@pytest.mark.gpu
@requires_gpu
def test_gpu_flags_nan_rows():
    data = bytearray(encode_logits(torch.zeros(2, 64), "fp8_e4m3").data)
    data[64 + 5] = 0x7F  # NaN in row 1
    encoded = EncodedLogits("fp8_e4m3", 2, 64, bytes(data), (1.0, 1.0))
    with pytest.raises(ValueError, match="target_logits row 1"):
        validate_from_stats(CudaRowStats()(encoded, [1], [-1]), [1], [-1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_nodes", [0, 8])
def test_cuda_host_glue_with_an_emulated_kernel(fake_cupy, random_tree_logits, fmt, num_nodes):
    token_ids, parents, logits = random_tree_logits(num_nodes, 40, seed=num_nodes + 3)
    encoded = encode_logits(logits, fmt)
    emulated, cpu = CudaRowStats()(encoded, token_ids, parents), row_stats_cpu(encoded, token_ids, parents)
    assert emulated.child_logits.shape == (num_nodes,)
    assert_stats_match(emulated, cpu)
    assert validate_from_stats(emulated, token_ids, parents) == validate_from_stats(cpu, token_ids, parents)
    allowed = random_mask(num_nodes + 1, 40, token_ids, parents, seed=num_nodes)
    assert_stats_match(
        CudaRowStats()(encoded, token_ids, parents, allowed), row_stats_cpu(encoded, token_ids, parents, allowed)
    )


def test_rows_that_do_not_fit_the_tree_are_refused_before_the_launch(fake_cupy):
    """The kernel reads each row's CSR offsets (N + 2 of them) and writes children by node index: more
    rows than N + 1 would read past them on the device. Refused as the reference refuses them."""
    encoded = encode_logits(torch.zeros(3, 8), "fp32")
    with pytest.raises(ValueError, match="target_logits has 3 rows, expected num_nodes \\+ 1 = 2"):
        CudaRowStats()(encoded, [1], [-1])
    assert fake_cupy.launches == 0
