"""The feature decoder (EAGLE-2 trees over the primary's features): incremental drafting equals the
whole-sequence reference (`unrolled`), the tree's shape, the features' bookkeeping (gaps, overlaps,
window), and the pool's handling of its file (refused files, requests naming it without one)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import structlog
import structlog.testing
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draft_svc.heads import file as drafter_file
from draft_svc.heads.model import DrafterConfig, FeatureDrafter, SharedParts, unrolled
from specdec.model.fingerprint import model_fingerprint
from draft_svc.pool import DraftPool, PoolConfig
from specdec.propose_args import ProposeArgs
from draft_svc.strategies import DecoderRegistry, model_free_registry
from draft_svc.strategies.feature import FeatureDecoder, FeatureDrafterSource, FeatureTreeConfig
from specdec.errors import InvalidArgument
from tests.draft_svc.tiny_drafter import TINY, tiny_parts


def model_parts(model, num_draft_vocab: int = 2048, seed: int = 0) -> tuple[FeatureDrafter, SharedParts]:
    from draft_svc.heads.model import shared_parts

    torch.manual_seed(seed)
    config = DrafterConfig.for_model(model.config, num_draft_vocab)
    drafter = FeatureDrafter(config).eval().requires_grad_(False)
    return drafter, shared_parts(model, torch.arange(num_draft_vocab), config.rms_norm_eps)


def context(config: DrafterConfig, num_tokens: int, seed: int = 1) -> tuple[list[int], torch.Tensor]:
    """Token ids x_0..x_{T-1} and features F [T-1, C]: row i predicts the token at position 1 + i."""
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=g).tolist()
    return token_ids, torch.randn(num_tokens - 1, config.hidden_size, generator=g)


def reference(drafter, shared, token_ids, features, draft_ids) -> list[torch.Tensor]:
    """unrolled's f^ of a chain: after the context, then after each draft token (rows past the
    context pair a dummy feature with the draft token; pass d at the context's last index + d - 1)."""
    num_ctx = len(token_ids)
    ids = torch.tensor(token_ids[1:] + list(draft_ids))
    rows = torch.cat((features, torch.zeros(len(draft_ids), features.shape[1])))
    positions = torch.arange(1, num_ctx + len(draft_ids))
    out = unrolled(
        drafter,
        shared,
        rows[None],
        shared.embed(ids).float()[None],
        positions[None],
        torch.ones(1, len(ids), dtype=torch.bool),
        len(draft_ids) + 1,
    )
    return [out[d][0, num_ctx - 2 + d] for d in range(len(draft_ids) + 1)]


def started(drafter, shared, token_ids, features, tree=None) -> FeatureDecoder:
    decoder = FeatureDecoder(drafter, shared, tree or FeatureTreeConfig())
    decoder.extend(token_ids)
    decoder.observe_features(1, features.numpy())
    return decoder


def greedy_chain(decoder: FeatureDecoder, shared, depth: int) -> list[int]:
    chain: list[int] = []
    for _ in range(depth):
        f = decoder.features_along(chain)[-1]
        chain.append(int(shared.vocab[shared.logits(f).argmax()]))
    return chain


def assert_greedy_chain_equals_unrolled(drafter, shared, token_ids, features, tolerance: float) -> list[int]:
    """A greedy chain of 3 drafted incrementally after the context: its features equal the reference's
    within `tolerance`, its logits within 10 x `tolerance`. Returns the chain."""
    decoder = started(drafter, shared, token_ids, features)
    chain = greedy_chain(decoder, shared, 3)
    got = decoder.features_along(chain)
    for d, want in enumerate(reference(drafter, shared, token_ids, features, chain)):
        torch.testing.assert_close(got[d], want, atol=tolerance, rtol=tolerance)
        logits_tolerance = 10 * tolerance
        torch.testing.assert_close(
            shared.logits(got[d]), shared.logits(want), atol=logits_tolerance, rtol=logits_tolerance
        )
    return chain


@pytest.mark.parametrize("num_tokens", [2, 9])
def test_incremental_chain_equals_unrolled_tiny(num_tokens):
    drafter, shared = tiny_parts()
    token_ids, features = context(TINY, num_tokens)
    chain = assert_greedy_chain_equals_unrolled(drafter, shared, token_ids, features, tolerance=1e-5)
    # The tree search with one child per node and a beam of one is that greedy chain
    chain_decoder = started(drafter, shared, token_ids, features, FeatureTreeConfig(top_k=1, beam=1))
    assert chain_decoder.propose(3, 1)[0].token_ids == tuple(chain)


def test_incremental_chain_equals_unrolled_on_the_model(fp32_model):
    drafter, shared = model_parts(fp32_model.model)
    token_ids, features = context(drafter.config, 40)
    assert_greedy_chain_equals_unrolled(drafter, shared, token_ids, features, tolerance=1e-4)


def test_steps_fed_one_verify_at_a_time_equal_one_feed():
    drafter, shared = tiny_parts()
    token_ids, features = context(TINY, 12)
    whole = started(drafter, shared, token_ids, features)
    stepped = FeatureDecoder(drafter, shared)
    stepped.extend(token_ids[:5])
    stepped.observe_features(4, features[3:4].numpy())  # after the prefill: the row of the last prompt token
    stepped.observe_features(1, features[:3].numpy())  # older rows: already past them, skipped
    assert stepped.is_current
    stepped.extend(token_ids[5:8])
    assert not stepped.is_current and stepped.propose(4, 2) == ()  # no features for the new tokens yet
    stepped.observe_features(5, features[4:7].numpy())
    stepped.extend(token_ids[8:])
    stepped.observe_features(6, features[5:].numpy())  # overlaps the last step's rows
    # the first feed started at position 4: its window lacks rows 1..3, so compare with a decoder fed the same
    same_rows = FeatureDecoder(drafter, shared)
    same_rows.extend(token_ids)
    same_rows.observe_features(4, features[3:].numpy())
    torch.testing.assert_close(stepped.features_along([]), same_rows.features_along([]))
    assert stepped.propose(4, 3) == same_rows.propose(4, 3)
    assert whole.is_current


def test_a_gap_restarts_the_window_from_the_new_rows():
    drafter, shared = tiny_parts()
    token_ids, features = context(TINY, 12)
    decoder = started(drafter, shared, token_ids[:6], features[:5])
    decoder.extend(token_ids[6:])
    decoder.observe_features(8, features[7:].numpy())  # rows for positions 6, 7 never came
    fresh = FeatureDecoder(drafter, shared)
    fresh.extend(token_ids)
    fresh.observe_features(8, features[7:].numpy())
    torch.testing.assert_close(decoder.features_along([3]), fresh.features_along([3]))


def test_the_window_slides():
    config = dataclasses.replace(TINY, max_window=4)
    drafter, shared = tiny_parts(config)
    token_ids, features = context(config, 300)
    decoder = FeatureDecoder(drafter, shared)
    decoder.extend(token_ids[:2])
    decoder.observe_features(1, features[:1].numpy())
    for start in range(2, 300, 3):  # verify steps of three tokens: the buffer compacts many times over
        end = min(start + 3, 300)
        decoder.extend(token_ids[start:end])
        decoder.observe_features(start, features[start - 1 : end - 1].numpy())
    assert decoder.num_tokens == 300 and decoder.is_current
    # the last f^ sees exactly the newest four inputs: unrolled over those rows alone
    ids = torch.tensor(token_ids[-4:])
    out = unrolled(
        drafter,
        shared,
        features[None, -4:],
        shared.embed(ids).float()[None],
        torch.arange(296, 300)[None],
        torch.ones(1, 4, dtype=torch.bool),
        1,
    )
    torch.testing.assert_close(decoder.features_along([])[0], out[0][0, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("depth", "num_candidates", "max_nodes"), [(1, 4, 0), (4, 4, 10), (6, 8, 0), (5, 16, 32)])
def test_tree_is_closed_within_budget_and_ranked(depth, num_candidates, max_nodes):
    drafter, shared = tiny_parts()
    token_ids, features = context(TINY, 20)
    decoder = started(drafter, shared, token_ids, features)
    candidates = decoder.propose(depth, num_candidates, max_nodes=max_nodes)
    budget = min(num_candidates * depth, max_nodes or num_candidates * depth)
    assert 1 <= len(candidates) <= num_candidates
    assert [c.rank for c in candidates] == list(range(len(candidates)))
    assert len({c.token_ids for c in candidates}) == len(candidates)
    assert all(1 <= c.num_tokens <= depth and c.decoder == "feature" for c in candidates)
    nodes = {c.token_ids[:i] for c in candidates for i in range(1, c.num_tokens + 1)}  # prefixes shared
    assert len(nodes) <= budget
    for c in candidates:  # every path ends at a leaf of the tree
        assert not any(other.token_ids[: c.num_tokens] == c.token_ids and other != c for other in candidates)

    def cum(path: tuple[int, ...]) -> float:
        return float(torch.tensor([prob_of(decoder, shared, path[:i], path[i]) for i in range(len(path))]).prod())

    leaf_probs = [cum(c.token_ids) for c in candidates]
    assert leaf_probs == sorted(leaf_probs, reverse=True) or np.allclose(leaf_probs, sorted(leaf_probs, reverse=True))


def prob_of(decoder, shared, prefix: tuple[int, ...], token_id: int) -> float:
    probs = torch.softmax(shared.logits(decoder.features_along(list(prefix))[-1]), dim=-1)
    return float(probs[(shared.vocab == token_id).nonzero()[0, 0]])


def test_propose_leaves_the_committed_state_and_release_frees_it():
    drafter, shared = tiny_parts()
    token_ids, features = context(TINY, 20)
    decoder = started(drafter, shared, token_ids, features)
    before = decoder.features_along([])
    first = decoder.propose(6, 8, max_nodes=32)
    assert decoder.propose(6, 8, max_nodes=32) == first
    torch.testing.assert_close(decoder.features_along([]), before, atol=0, rtol=0)
    assert decoder.num_kv_bytes > 0
    decoder.release()
    assert decoder.num_kv_bytes == 0 and decoder.propose(4, 1) == ()


# --- the file and the pool --------------------------------------------------------------------


class Models:
    def __init__(self, model) -> None:
        self.model = model

    def current_model(self):
        return ("instance-1", self.model)

    def vocab_size(self) -> int:
        return TINY.vocab_size

    def max_context_length(self) -> int | None:
        return None


def write_drafter(path, model) -> None:
    drafter, _ = tiny_parts()
    fingerprint = model_fingerprint(model.config, model.norm.weight)
    drafter_file.save(path, drafter, torch.arange(TINY.draft_vocab_size), fingerprint, {"seed": 0})


def pool_with(source: FeatureDrafterSource, model) -> DraftPool:
    based = DecoderRegistry()
    based.register(FeatureDecoder.name, source.create)
    config = PoolConfig(strategies=("prompt_lookup", "feature"), default_strategies=("prompt_lookup",))
    return DraftPool(config, model_free_registry(), based, Models(model), refusal=source.refusal_of)


def test_a_bound_drafter_proposes_through_the_pool_once_it_has_features(tmp_path, fake_primary):
    model = fake_primary(TINY)
    write_drafter(tmp_path / "d.safetensors", model)
    source = FeatureDrafterSource(tmp_path / "d.safetensors")
    assert source.is_loaded and source.bind(model) is not None and source.refusal() is None
    pool = pool_with(source, model)
    args = ProposeArgs("r", prompt_token_ids=(1, 2, 3, 4), strategies=("feature", "feature"), draft_length=4)
    assert pool.propose(args).tree.token_ids == ()  # no features yet: nothing, no error
    decoder = pool._requests["r"].decoders["feature"]
    assert isinstance(decoder, FeatureDecoder)
    decoder.observe_features(3, np.random.default_rng(0).standard_normal((1, TINY.hidden_size), dtype=np.float32))
    proposal = pool.propose(ProposeArgs("r", strategies=("feature", "feature"), draft_length=4, max_nodes=5))
    assert 1 <= len(proposal.tree.token_ids) <= 5


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _other_format(path):
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")


def _metadata_not_an_object(path):
    header = b'{"__metadata__": ["format"]}'
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def _deeply_nested_header(path):
    header = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def _rewrite(path, config=None, tensors=None):
    """The file again with some config fields or tensors replaced (a hand-edited or corrupted file)."""
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}
    if config is not None:
        metadata["config"] = json.dumps({**json.loads(metadata["config"]), **config})
    save_file({**state, **(tensors or {})}, str(path), metadata=metadata)


def _huge_config(path):
    # a header claiming a layer of 2^30 x 2^30: refused from the shapes, nothing of that size allocated
    _rewrite(path, config={"hidden_size": 1 << 30, "intermediate_size": 1 << 32})


def _huge_window(path):
    # every request would allocate keys and values of 2^40 rows
    _rewrite(path, config={"max_window": 1 << 40})


def _nan_weights(path):
    with safe_open(str(path), "pt") as f:
        weight = f.get_tensor("drafter.fc.weight")
    _rewrite(path, tensors={"drafter.fc.weight": torch.full_like(weight, float("nan"))})


def _float_vocab(path):
    with safe_open(str(path), "pt") as f:
        vocab = f.get_tensor("vocab")
    _rewrite(path, tensors={"vocab": vocab.float() + 0.5})


def _integer_weights(path):
    with safe_open(str(path), "pt") as f:
        weight = f.get_tensor("drafter.fc.weight")
    _rewrite(path, tensors={"drafter.fc.weight": torch.ones_like(weight, dtype=torch.int8)})


@pytest.mark.parametrize(
    "spoil",
    [
        None,
        _truncate,
        _other_format,
        _metadata_not_an_object,
        _deeply_nested_header,
        _huge_config,
        _huge_window,
        _nan_weights,
        _float_vocab,
        _integer_weights,
    ],
)
def test_a_missing_or_unreadable_file_takes_the_strategy_off_the_pool(tmp_path, spoil, fake_primary):
    from draft_svc.__main__ import build
    from draft_svc.config import from_args

    path = tmp_path / "d.safetensors"
    if spoil is not None:
        write_drafter(path, fake_primary(TINY))
        spoil(path)
    config = from_args(["--strategies", "prompt_lookup,feature", "--feature_drafter", str(path)], {})
    assert "feature" in config.pool.strategies
    with structlog.testing.capture_logs() as logs:
        _, pool, _ = build(config, client=None)
    assert [log["reason"] for log in logs if log["event"] == "feature_drafter_unavailable"] == [
        pool._refusal("feature")
    ]
    assert "feature" not in pool.config.strategies and "prompt_lookup" in pool.config.strategies
    with pytest.raises(InvalidArgument) as e:
        pool.propose(ProposeArgs("r", prompt_token_ids=(1, 2), strategies=("feature",)))
    assert e.value.field == "strategies" and "'feature'" in str(e.value) and str(path) in str(e.value)
    # the others still serve
    assert pool.propose(ProposeArgs("r", prompt_token_ids=(1, 2, 1), strategies=("prompt_lookup",))) is not None


def test_a_pool_of_the_feature_strategy_alone_starts_without_its_file_and_says_why(tmp_path):
    """--strategies feature with no drafter file: the pool starts (its configured strategy list was left
    empty, which PoolConfig refused: a ValueError at start) and every request is refused by name."""
    from draft_svc.__main__ import build
    from draft_svc.config import from_args

    path = tmp_path / "missing.safetensors"
    config = from_args(["--strategies", "feature", "--feature_drafter", str(path)], {})
    with structlog.testing.capture_logs() as logs:
        _, pool, _ = build(config, client=None)
    assert [log["event"] for log in logs if log["event"] == "feature_drafter_unavailable"]
    assert pool.offered_strategies() == ()
    for strategies in ((), ("feature",)):  # the default, and by name
        with pytest.raises(InvalidArgument) as e:
            pool.propose(ProposeArgs("r", prompt_token_ids=(1, 2), strategies=strategies))
        assert e.value.field == "strategies" and "'feature'" in str(e.value) and str(path) in str(e.value)
    pool.close()


def test_a_drafter_of_another_model_is_refused_when_the_weights_attach(tmp_path, fake_primary):
    write_drafter(tmp_path / "d.safetensors", fake_primary(TINY, seed=0))
    source = FeatureDrafterSource(tmp_path / "d.safetensors")
    other = fake_primary(TINY, seed=1)
    with structlog.testing.capture_logs() as logs:
        assert source.is_loaded and source.bind(other) is None
    assert [log["event"] for log in logs] == ["feature_drafter_refused"]
    assert "trained for model" in (source.refusal() or "")
    pool = pool_with(source, other)
    with pytest.raises(InvalidArgument) as e:
        pool.propose(ProposeArgs("r", prompt_token_ids=(1, 2), strategies=("feature",)))
    assert "'feature'" in str(e.value) and str(tmp_path / "d.safetensors") in str(e.value)
    proposal = pool.propose(ProposeArgs("r", prompt_token_ids=(1, 2, 1), strategies=("prompt_lookup",)))
    assert proposal.tree.decoders == ("prompt_lookup",)


def test_a_drafter_whose_config_is_not_the_models_is_refused_when_the_weights_attach(tmp_path, fake_primary):
    """A file bound to the model's fingerprint but with a config of another vocabulary: its token ids
    past the model's vocabulary are refused (logged), not looked up in the model's embedding (an
    IndexError that failed the attach of the weights for every model-based strategy)."""
    model = fake_primary(TINY)
    wider = dataclasses.replace(TINY, vocab_size=TINY.vocab_size + 10)
    vocab = torch.arange(wider.vocab_size - wider.draft_vocab_size, wider.vocab_size)
    path = tmp_path / "d.safetensors"
    drafter_file.save(path, FeatureDrafter(wider), vocab, model_fingerprint(model.config, model.norm.weight), {})
    source = FeatureDrafterSource(path)
    with structlog.testing.capture_logs() as logs:
        assert source.is_loaded and source.bind(model) is None
    assert [log["event"] for log in logs] == ["feature_drafter_refused"]
    assert f"vocab_size {wider.vocab_size} (the model's {TINY.vocab_size})" in (source.refusal() or "")
    with pytest.raises(InvalidArgument) as e:
        pool_with(source, model).propose(ProposeArgs("r", prompt_token_ids=(1, 2), strategies=("feature",)))
    assert "'feature'" in str(e.value) and str(path) in str(e.value)


def test_tree_attention_gives_each_beam_row_what_its_chain_alone_gives():
    drafter, shared = tiny_parts()
    token_ids, features = context(TINY, 20)
    decoder = started(drafter, shared, token_ids, features, FeatureTreeConfig(top_k=3, beam=3))
    with torch.inference_mode():
        head_ids, parents, cum_probs = decoder._grow(4)
    assert len(head_ids) == 3 + 3 * 9  # depth 1: top 3; depths 2..4: 3 beam rows x 3 children
    vocab = shared.vocab.tolist()
    for node in range(len(head_ids)):
        path = []
        n = node
        while n >= 0:
            path.append(vocab[head_ids[n]])
            n = parents[n]
        path.reverse()
        want = torch.tensor([prob_of(decoder, shared, tuple(path[:i]), path[i]) for i in range(len(path))]).prod()
        torch.testing.assert_close(cum_probs[node], want, atol=1e-5, rtol=1e-4)


def test_the_pool_hands_a_tree_decoder_the_node_budget_and_refuses_requests_naming_it_when_refused():
    seen: list[int] = []
    released: list[bool] = []
    reason: list[str] = []

    def refusal(name: str) -> str | None:
        return reason[0] if reason and name == "feature" else None

    class Budgeted:
        name = "feature"
        takes_max_nodes = True

        def __init__(self, model) -> None:
            pass

        def extend(self, token_ids) -> None:
            pass

        def propose(self, max_tokens: int, max_candidates: int = 1, *, max_nodes: int = 0):
            seen.append(max_nodes)
            return ()

        def release(self) -> None:
            released.append(True)

    based = DecoderRegistry()
    based.register("feature", Budgeted)
    config = PoolConfig(strategies=("prompt_lookup", "feature"), default_strategies=("prompt_lookup",))
    pool = DraftPool(config, model_free_registry(), based, Models(object()), refusal=refusal)
    pool.propose(ProposeArgs("r", prompt_token_ids=(1, 2), strategies=("feature", "feature"), draft_length=4))
    pool.propose(ProposeArgs("r", strategies=("feature",), draft_length=4, max_nodes=3))
    assert seen == [8, 3]  # degree x draft_length by default, else the request's max_nodes
    reason.append("drafter file x was trained for model a, but the primary serves model b")
    with pytest.raises(InvalidArgument, match="'feature' is not served by this pool: drafter file x"):
        pool.propose(ProposeArgs("r", strategies=("feature",)))
    assert pool.propose(ProposeArgs("r", strategies=("prompt_lookup",))).tree.decoders == ("prompt_lookup",)
    pool.release("r", is_finished=False)
    assert released == [True]


def test_native_int8_products_draft_what_fp32_drafts(fp32_model):
    """Serving runs the drafter's products (and its head) on the native int8 kernels: the f^ it predicts
    stays within a few percent of fp32's, and the chosen draft tokens are mostly the same."""
    from draft_svc.heads.model import for_serving
    from specdec.model import native

    lib = native.library()
    if lib is None:
        pytest.skip("the native kernels are not built on this machine")
    drafter, shared = model_parts(fp32_model.model)
    fast_drafter, fast_shared = for_serving(*model_parts(fp32_model.model), lib)
    token_ids, features = context(drafter.config, 64)
    features = features * 3  # about the primary's feature scale
    slow = FeatureDecoder(drafter, shared)
    fast = FeatureDecoder(fast_drafter, fast_shared)
    for decoder in (slow, fast):
        decoder.extend(token_ids)
        decoder.observe_features(1, features)
    draft = [int(t) for t in torch.randint(0, 2048, (4,), generator=torch.Generator().manual_seed(3))]
    want, got = slow.features_along(draft), fast.features_along(draft)
    assert torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want) < 0.05
    agree = (shared.logits(want).argmax(-1) == fast_shared.logits(got).argmax(-1)).float().mean()
    assert agree >= 0.8


def test_fused_serving_products_give_the_separate_products_outputs(fp32_model):
    """for_serving runs q|k|v and gate|up as one native product each: the same int8 rows and scales
    side by side, so the drafter's keys, values and layer output are those of the separate products."""
    from draft_svc.heads.model import FUSED_PRODUCTS, _NativeProduct, for_serving
    from specdec.model import native

    lib = native.library()
    if lib is None:
        pytest.skip("the native kernels are not built on this machine")
    fused, _ = for_serving(*model_parts(fp32_model.model), lib)
    separate, _ = for_serving(*model_parts(fp32_model.model), lib)
    assert all(isinstance(getattr(fused, name), _NativeProduct) for name in FUSED_PRODUCTS)
    for name, parts in FUSED_PRODUCTS.items():
        for part in parts:  # the parts as for_serving would make them alone
            setattr(separate, part, _NativeProduct(lib, getattr(separate, part).weight, None))
        setattr(separate, name, None)
    u = torch.randn(5, fused.config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(10, 15)
    with torch.inference_mode():
        want, got = separate.keys_values(u, positions), fused.keys_values(u, positions)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
        q, k, v = got
        assert torch.equal(separate.finish(u, q, k, v, None), fused.finish(u, q, k, v, None))


def test_the_native_layer_drafts_what_the_torch_layer_drafts(fp32_model):
    """Serving runs the drafter's whole layer in one native call (NativeLayer: the cache write, tree
    attention under the mask, the MLP): its features and tree are the torch layer's over the same
    int8 products within float rounding, after a long feed (keys and values alone, then its last row)
    and feeds of one row a step."""
    from draft_svc.heads.model import NativeLayer, for_serving
    from draft_svc.strategies.feature import NATIVE_OBSERVE_ROWS
    from specdec.model import native

    lib = native.library()
    if lib is None:
        pytest.skip("the native kernels are not built on this machine")
    drafter, shared = for_serving(*model_parts(fp32_model.model), lib)
    native_layer = drafter.native_layer
    assert isinstance(native_layer, NativeLayer)
    token_ids, features = context(drafter.config, 48)
    features = features * 3  # about the primary's feature scale
    assert 29 > NATIVE_OBSERVE_ROWS
    out = {}
    for name, layer in (("native", native_layer), ("torch", None)):
        drafter.native_layer = layer
        decoder = FeatureDecoder(drafter, shared, FeatureTreeConfig(top_k=3, beam=3))
        decoder.extend(token_ids[:30])
        decoder.observe_features(1, features[:29])
        for i in range(30, 48):
            decoder.extend([token_ids[i]])
            decoder.observe_features(i, features[i - 1 : i])
        with torch.inference_mode():
            out[name] = (decoder.features_along([5, 17, 230]), decoder._grow(4))
    (got, (got_ids, got_parents, got_probs)), (want, (want_ids, want_parents, want_probs)) = out["native"], out["torch"]
    assert torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want) < 1e-3
    assert (got_ids, got_parents) == (want_ids, want_parents)
    torch.testing.assert_close(got_probs, want_probs, atol=1e-4, rtol=1e-3)


def test_requests_draft_through_the_shared_native_layer_at_once(fp32_model):
    """The pool runs requests' decoders on its threads at once, all over one drafter: each call of the
    native layer keeps its work to its own buffers, so concurrent proposals equal one-at-a-time ones."""
    from concurrent.futures import ThreadPoolExecutor

    from draft_svc.heads.model import for_serving
    from specdec.model import native

    lib = native.library()
    if lib is None:
        pytest.skip("the native kernels are not built on this machine")
    drafter, shared = for_serving(*model_parts(fp32_model.model), lib)
    assert drafter.native_layer is not None

    def proposals(seed: int) -> list[tuple[int, ...]]:
        token_ids, features = context(drafter.config, 40, seed=seed)
        decoder = started(drafter, shared, token_ids, features * 3, FeatureTreeConfig(top_k=2, beam=2))
        out = []
        for i in range(8):  # a step: propose, then the committed token and its row's feature
            out.extend(c.token_ids for c in decoder.propose(4, 2))
            decoder.extend([token_ids[i]])
            decoder.observe_features(len(token_ids) + i, features[i : i + 1] * 3)
        assert len(out) == 16
        return out

    seeds = list(range(1, 7))
    alone = [proposals(seed) for seed in seeds]
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(proposals, seeds)) == alone


@pytest.mark.parametrize("width", [TINY.hidden_size - 1, TINY.hidden_size + 1])
def test_features_of_another_width_than_the_model_s_are_refused_naming_the_field(tmp_path, fake_primary, width):
    """Rows of another width than the attached model's hidden size cannot be the primary's features:
    the feature decoder's ValueError made the Propose an INTERNAL error, after the call's tokens had
    joined the request's context."""
    model = fake_primary(TINY)
    write_drafter(tmp_path / "d.safetensors", model)
    pool = pool_with(FeatureDrafterSource(tmp_path / "d.safetensors"), model)
    rows = np.zeros((1, width), dtype=np.float32)
    with pytest.raises(InvalidArgument) as e:  # the opening call: no request is left behind
        pool.propose(
            ProposeArgs("r", prompt_token_ids=(1, 2, 3, 4), strategies=("feature",), features=rows, feature_position=3)
        )
    assert e.value.field == "features" and str(TINY.hidden_size) in str(e.value)
    assert pool.num_requests == 0
    pool.propose(ProposeArgs("r", prompt_token_ids=(1, 2, 3, 4), strategies=("feature",)))
    with pytest.raises(InvalidArgument) as e:
        pool.propose(ProposeArgs("r", new_token_ids=(5,), strategies=("feature",), features=rows, feature_position=4))
    assert e.value.field == "features"
    assert pool._requests["r"].token_ids == [1, 2, 3, 4]  # the refused call's tokens were not taken
    good = np.zeros((1, TINY.hidden_size), dtype=np.float32)
    pool.propose(ProposeArgs("r", new_token_ids=(5,), strategies=("feature",), features=good, feature_position=4))
    assert pool._requests["r"].decoders["feature"].is_current
