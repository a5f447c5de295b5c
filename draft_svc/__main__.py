"""`python -m draft_svc`: the draft pool service (see draft_svc/config.py for flags and env)."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch
from prometheus_client import CollectorRegistry

from draft_svc.config import DraftConfig, from_args
from draft_svc.costs import DraftCosts, fit_cost, measure_propose_ms
from draft_svc.corpus.store import open_index
from draft_svc.pool import DraftPool
from draft_svc.priors import drafter_file_acceptance
from draft_svc.primary_client import GrpcPrimaryClient
from draft_svc.server import DraftServicer
from draft_svc.strategies import DecoderRegistry, model_free_registry, prediction_registry
from draft_svc.strategies.base import DraftDecoder
from draft_svc.strategies.corpus import PendingCorpusIndex
from draft_svc.strategies.feature import FeatureDecoder, FeatureDrafterSource
from draft_svc.strategies.grammar_forced import register_grammar_decoder
from draft_svc.strategies.self_draft import self_draft_registry
from draft_svc.strategies.suffix_index import ContinuationIndex, SuffixIndex
from draft_svc.weights import PrimaryClient, WeightAttacher
from specdec.grammar import GrammarCache, GrammarTokenizerInfo
from specdec.logging import configure_service_telemetry
from specdec.flags import config_or_exit
from specdec.model.loader import resolve_model_dir
from specdec.model.tokenizer import Tokenizer
from draft_svc.metrics import DraftMetrics
from specdec.service.auth import serve_internal, service_token_or_exit
from specdec.v1 import draft_pb2_grpc

EXPIRY_CHECK_MAX_S = 60.0  # the most time between two checks for idle requests (expire_idle_requests)


def build(
    config: DraftConfig,
    client: PrimaryClient | None,
    metrics: DraftMetrics | None = None,
    grammars: GrammarCache | None = None,
    corpus: ContinuationIndex | None = None,
) -> tuple[DraftServicer, DraftPool, WeightAttacher]:
    """The servicer and what it runs on; the attacher's monitor is not started yet. `grammars` is
    needed when the pool offers grammar-forced drafts, `corpus` (the index) when it offers corpus drafts."""
    model_based = self_draft_registry(config.self_draft)
    config, feature = _feature_drafter(config, model_based)
    costs = DraftCosts()

    def check_model(model) -> None:
        # Resolve the configured layers against the model now, not in a request.
        for name in config.pool.strategies:
            if name == FeatureDecoder.name and feature is not None:
                # a drafter of another model is refused (logged), not the weights
                if feature.bind(model) is None:
                    costs.discard(name)
                else:
                    _measure_cost(costs, name, functools.partial(feature.create, model=model), model.config)
            elif name in model_based:
                model_based.create(name, model=model)

    # Without model-based strategies the primary is still asked for its vocabulary (to validate
    # token ids), but its weights are not mapped.
    attacher = WeightAttacher(
        client,
        check_model=check_model,
        max_context=config.max_context,
        poll_interval_s=config.attach_poll_s,
        is_attaching=config.has_model_strategies,
    )
    grammar_based = DecoderRegistry()
    if config.has_grammar_strategies:
        if grammars is None:
            raise ValueError("grammar-forced drafts need a GrammarCache")
        register_grammar_decoder(grammar_based, grammars)
    if config.has_corpus_strategy and corpus is None:
        raise ValueError("corpus drafts need a corpus index")
    index = SuffixIndex(config.suffix_index)
    pool = DraftPool(
        config.pool,
        model_free_registry(suffix_index=index, corpus=corpus),
        model_based,
        attacher,
        suffix_index=index,
        grammar_based=grammar_based,
        grammars=grammars,
        refusal=None if feature is None else feature.refusal_of,
        prediction_based=prediction_registry(),
    )
    priors = {}
    if feature is not None and feature.is_loaded:
        if by_depth := drafter_file_acceptance(feature.path):
            priors[FeatureDecoder.name] = by_depth
    return DraftServicer(pool, attacher, metrics, costs, priors), pool, attacher


def _measure_cost(costs: DraftCosts, name: str, create: Callable[[], DraftDecoder], model_config: Any) -> None:
    """Measure a bound decoder's Propose on this machine (GetPoolInfo reports it; draft_svc/costs.py).
    A failure is logged and leaves the strategy priced by the gateway's default: never the attach."""
    log = structlog.get_logger("draft_svc")
    try:
        cost = fit_cost(measure_propose_ms(create(), model_config.vocab_size, model_config.hidden_size))
    except Exception:  # noqa: BLE001 - a measure must not refuse weights the strategies fit
        log.exception("draft_cost_not_measured", strategy=name)
        costs.discard(name)
        return
    costs.set(name, cost)
    log.info(
        "draft_cost_measured",
        strategy=name,
        fixed_ms=round(cost.fixed_ms, 3),
        per_token_ms=round(cost.per_token_ms, 3),
        depth_ms={d: round(ms, 3) for d, ms in cost.depth_ms},
    )


def _feature_drafter(
    config: DraftConfig, model_based: DecoderRegistry
) -> tuple[DraftConfig, FeatureDrafterSource | None]:
    """Read the feature drafter's file once and register its decoder; a file that is missing or
    unreadable takes the strategy off the pool's list (logged; requests naming it are told why), or,
    where it is the pool's only strategy, leaves it refused (a pool of no strategy is no config)."""
    if not config.has_feature_strategy:
        return config, None
    feature = FeatureDrafterSource(config.feature_drafter)
    if feature.is_loaded:
        model_based.register(FeatureDecoder.name, feature.create)
        return config, feature
    structlog.get_logger("draft_svc").warning("feature_drafter_unavailable", reason=feature.refusal())
    kept = tuple(n for n in config.pool.strategies if n != FeatureDecoder.name)
    if not kept:  # the pool's only strategy: it stays listed, and every request is told why it is refused
        model_based.register(FeatureDecoder.name, feature.create)
        return config, feature
    defaults = tuple(n for n in config.pool.default_strategies if n != FeatureDecoder.name) or kept[:1]
    pool = dataclasses.replace(config.pool, strategies=kept, default_strategies=defaults)
    return dataclasses.replace(config, pool=pool), feature


def expire_idle_requests(
    pool: DraftPool, stop: threading.Event, metrics: DraftMetrics | None = None, check_s: float | None = None
) -> None:
    """Drop the pool's requests idle past --request_ttl_s, checking a few times per ttl (every check_s
    when given), until `stop` is set: without it only a Propose dropped them, and a pool that heard no
    more Proposes kept every idle request's state."""
    log = structlog.get_logger("draft_svc")
    every_s = min(pool.config.request_ttl_s / 4, EXPIRY_CHECK_MAX_S) if check_s is None else check_s
    while not stop.wait(every_s):
        try:
            if pool.expire_idle() and metrics is not None:
                metrics.requests.set(pool.num_requests)
                metrics.state_bytes.set(pool.num_kv_bytes)
        except Exception:  # noqa: BLE001 - the thread must outlive one failure
            log.exception("draft request expiry failed")


def main(argv: Sequence[str] | None = None) -> None:
    config = config_or_exit("python -m draft_svc", from_args, argv, os.environ)
    configure_service_telemetry("draft", config.log_level, os.environ)
    log = structlog.get_logger("draft_svc")
    service_token = service_token_or_exit(config.service_token_file, config.is_unauthenticated_allowed)
    if config.num_torch_threads:
        torch.set_num_threads(config.num_torch_threads)
    client = GrpcPrimaryClient(config.primary_address, service_token=service_token) if config.primary_address else None
    registry = CollectorRegistry()
    metrics = DraftMetrics(registry)
    grammars = corpus = None
    # the tokenizer only: weights come from the primary
    if config.has_grammar_strategies or config.has_corpus_strategy:
        model_dir = resolve_model_dir(config.model_path, config.cache_dir, show_progress=sys.stderr.isatty())
    if config.has_grammar_strategies:  # ~1 s
        grammars = GrammarCache(GrammarTokenizerInfo.from_tokenizer(Tokenizer.from_dir(model_dir)))
    if config.has_corpus_strategy:  # mapped at once when cached, else built in the background (progress on stderr)
        corpus = PendingCorpusIndex(
            functools.partial(open_index, config.corpus, model_dir, config.corpus.cache_dir or config.cache_dir),
            config.corpus.query.max_match_len,
        )
    servicer, pool, attacher = build(config, client, metrics, grammars, corpus)
    log.info(
        "draft_pool_configured",
        strategies=list(pool.config.strategies),  # less a feature drafter whose file did not load
        default_strategies=list(pool.config.default_strategies),
        primary_address=config.primary_address,
    )

    def on_stopped() -> None:
        stop_expiry.set()
        attacher.stop()
        pool.close()
        if client is not None:
            client.close()

    stop_expiry = threading.Event()
    threading.Thread(
        target=expire_idle_requests, args=(pool, stop_expiry, metrics), name="draft-expiry", daemon=True
    ).start()
    attacher.start()  # attaches in the background: model-free strategies serve at once
    if corpus is not None:
        corpus.start()
    serve_internal(
        config.server,
        draft_pb2_grpc.add_DraftServiceServicer_to_server,
        servicer,
        service_token,
        metrics.rpc,
        registry=registry,
        on_stopped=on_stopped,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
