"""The draft service's configuration: CLI flags over environment variables over defaults.

The only module of the service that reads the environment (`from_args`' `environ`), through
specdec.service.flags: SPECDEC_DRAFT_<FLAG>, then SPECDEC_<FLAG> for the flags every service shares.

    python -m draft_svc --port 50052 --primary_address primary:50051 \\
        --strategies prompt_lookup,suffix_index,early_exit,layer_skip
    python -m draft_svc --strategies prompt_lookup,suffix_index,corpus --corpus_max_tokens 2000000

Environment (compose.yaml sets the first five for every service):
    SPECDEC_HOST, SPECDEC_PORT, SPECDEC_METRICS_PORT, SPECDEC_LOG_LEVEL, SPECDEC_PRIMARY_ADDRESS,
    SPECDEC_DRAFT_NUM_THREADS, SPECDEC_DRAFT_STRATEGIES, SPECDEC_DRAFT_DEFAULT_STRATEGIES,
    SPECDEC_DRAFT_LENGTH, SPECDEC_DRAFT_THREADS, SPECDEC_DRAFT_EARLY_EXIT_LAYERS,
    SPECDEC_DRAFT_SKIPPED_LAYERS, SPECDEC_DRAFT_MAX_CONTEXT, SPECDEC_DRAFT_ATTACH_POLL_S,
    SPECDEC_DRAFT_CORPUS_SOURCES, SPECDEC_DRAFT_CORPUS_PATHS, SPECDEC_DRAFT_CORPUS_MAX_TOKENS,
    SPECDEC_DRAFT_CORPUS_CACHE_DIR, SPECDEC_DRAFT_FEATURE_DRAFTER,
    SPECDEC_MODEL_PATH, SPECDEC_CACHE_DIR, SPECDEC_SERVICE_TOKEN_FILE, SPECDEC_ALLOW_UNAUTHENTICATED
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

from draft_svc.corpus.sources import SOURCES
from draft_svc.corpus.store import DEFAULT_MAX_TOKENS, CorpusConfig
from draft_svc.pool import PoolConfig
from draft_svc.strategies.self_draft import SelfDraftConfig
from draft_svc.strategies.suffix_index import SuffixIndexConfig
from specdec import strategies
from specdec.logging import LOG_LEVELS
from specdec.service.auth import add_service_token_arguments
from specdec.service.flags import Flags
from specdec.service.server import DEFAULT_HOST, ServerConfig
from specdec.flag_spellings import add_spellings

MODEL_FREE_STRATEGIES = strategies.names_of(strategies.MODEL_FREE)
GRAMMAR_STRATEGIES = strategies.names_of(strategies.GRAMMAR)
MODEL_STRATEGIES = strategies.names_of(strategies.MODEL)
PREDICTION_STRATEGIES = strategies.names_of(strategies.PREDICTION)
# Offered by default: the requests' defaults, lookahead (it costs nothing until a request or the
# gateway's default set names it), grammar-forced drafts for constrained requests, the feature
# drafter (dropped, with a log line, when its file does not load: draft_svc/__main__.py), and the
# prediction decoder for requests that carry a prediction.
OFFERED_STRATEGIES = (
    strategies.MODEL_FREE_DEFAULTS
    + (strategies.LOOKAHEAD_STRATEGY,)
    + GRAMMAR_STRATEGIES
    + (strategies.FEATURE_STRATEGY,)
    + PREDICTION_STRATEGIES
)
# The shipped drafter of the default model (trained by draft_svc/heads/train.py)
DEFAULT_FEATURE_DRAFTER = Path(__file__).parent / "heads" / "trained" / "smollm2-135m-instruct.safetensors"
DEFAULT_PORT = 50052
NO_PRIMARY = ""  # primary_address: model-free strategies only, unless a manifest arrives through Attach


@dataclasses.dataclass(frozen=True, slots=True)
class DraftConfig:
    server: ServerConfig
    pool: PoolConfig
    self_draft: SelfDraftConfig = SelfDraftConfig()
    suffix_index: SuffixIndexConfig = SuffixIndexConfig()
    corpus: CorpusConfig = CorpusConfig()  # the corpus decoder's index, when the pool offers it
    feature_drafter: Path = DEFAULT_FEATURE_DRAFTER  # the feature decoder's drafter file
    primary_address: str = NO_PRIMARY
    attach_poll_s: float = 5.0  # how often the primary's instance id is checked
    max_context: int = 0  # rotary table length of the draft model; 0 = the primary's context
    # Torch intra-op threads per process (0 = torch's default). One: the pool already runs a step's
    # decoders on parallel threads, and spare OpenMP workers spin on the cores the primary needs.
    num_torch_threads: int = 1
    log_level: str = "INFO"
    model_path: str | None = None  # the model's tokenizer for grammar-forced drafts (None: the default model)
    cache_dir: Path = Path.home() / ".cache" / "specdec" / "models"
    service_token_file: str = ""  # the shared secret callers must send, and this pool sends the primary
    is_unauthenticated_allowed: bool = False  # serve without a token (a trusted network only)

    def __post_init__(self) -> None:
        strategies.check_names(self.pool.strategies)
        if self.attach_poll_s <= 0:
            raise ValueError(f"attach_poll_s must be > 0, got {self.attach_poll_s}")
        if self.max_context < 0 or self.num_torch_threads < 0:
            raise ValueError("max_context and num_torch_threads must be >= 0")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")

    @property
    def has_grammar_strategies(self) -> bool:
        return any(name in GRAMMAR_STRATEGIES for name in self.pool.strategies)

    @property
    def has_corpus_strategy(self) -> bool:
        return strategies.CORPUS_STRATEGY in self.pool.strategies

    @property
    def has_feature_strategy(self) -> bool:
        return strategies.FEATURE_STRATEGY in self.pool.strategies

    @property
    def has_model_strategies(self) -> bool:
        return any(name in MODEL_STRATEGIES for name in self.pool.strategies)


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in _names(text))


def add_corpus_arguments(flags: Flags) -> None:
    """The corpus index's flags, shared with `python -m draft_svc.corpus` (which builds the same index)."""
    flags.add(
        "--model_path",
        None,
        env=("MODEL_PATH", "MODEL"),
        type=str,
        help="the model whose tokenizer grammar-forced and corpus drafts use (default: the default model)",
    )
    flags.add("--cache_dir", str(Path.home() / ".cache" / "specdec" / "models"))
    flags.add(
        "--corpus_sources",
        ",".join(SOURCES),
        shared=False,
        help=f"comma-separated corpus sources of the corpus decoder, of {','.join(SOURCES)} "
        "(draft_svc/corpus/sources.py); may be empty when --corpus_paths names files",
    )
    flags.add(
        "--corpus_paths",
        "",
        shared=False,
        help="comma-separated extra files or folders (.py .txt .md .rst .json) read after the sources",
    )
    flags.add(
        "--corpus_max_tokens",
        DEFAULT_MAX_TOKENS,
        shared=False,
        help="the corpus budget in tokens: bounds the build time and the index size (~10 bytes a token)",
    )
    flags.add(
        "--corpus_cache_dir",
        "",
        shared=False,
        help="where corpus indexes are kept (default: --cache_dir)",
    )


def corpus_config(a: argparse.Namespace) -> CorpusConfig:
    return CorpusConfig(
        sources=_names(a.corpus_sources),
        paths=tuple(Path(p) for p in _names(a.corpus_paths)),
        max_tokens=a.corpus_max_tokens,
        cache_dir=Path(a.corpus_cache_dir or a.cache_dir),
    )


def from_args(argv: Sequence[str] | None, environ: Mapping[str, str]) -> DraftConfig:
    p = argparse.ArgumentParser(prog="python -m draft_svc", description="The draft pool service.")
    flags = Flags(p, "DRAFT", environ)
    flags.add("--host", DEFAULT_HOST)
    flags.add("--port", DEFAULT_PORT)
    flags.add("--metrics_port", 0)
    flags.add("--log_level", "INFO")
    flags.add(
        "--primary_address",
        NO_PRIMARY,
        help="host:port of the primary whose weights the model-based strategies run on",
    )
    flags.add("--num_threads", 1, shared=False, help="torch intra-op threads (default 1; 0: torch's default)")
    add_corpus_arguments(flags)
    flags.add(
        "--strategies",
        ",".join(OFFERED_STRATEGIES),
        shared=False,
        help=f"comma-separated strategies this pool offers, of {','.join(strategies.NAMES)}",
    )
    flags.add(
        "--default_strategies",
        "",
        shared=False,
        help="strategies of a request that names none (default: the model-free ones offered)",
    )
    flags.add("--draft_length", 8)  # SPECDEC_DRAFT_LENGTH, the gateway's variable too
    flags.add("--draft_threads", 4, help="threads running one step's decoders in parallel")  # SPECDEC_DRAFT_THREADS
    flags.add(
        "--early_exit_layers",
        0,
        shared=False,
        help="layers the early-exit decoder runs (0: 3/4 of the model's)",
    )
    flags.add(
        "--skipped_layers",
        "",
        shared=False,
        help="comma-separated layers the layer-skip decoder skips (default: every other one from L/4 to 2L/3)",
    )
    flags.add(
        "--feature_drafter",
        str(DEFAULT_FEATURE_DRAFTER),
        shared=False,
        help="the feature decoder's drafter file (draft_svc/heads/file.py); when it is missing or was trained "
        "for another model the pool serves without the feature strategy",
    )
    flags.add("--max_context", 0, shared=False)
    flags.add("--attach_poll_s", 5.0, shared=False)
    add_service_token_arguments(flags)
    a = add_spellings(p).parse_args(argv)
    offered = _names(a.strategies)
    defaults = _names(a.default_strategies) or tuple(n for n in offered if n in MODEL_FREE_STRATEGIES) or offered
    try:
        return DraftConfig(
            server=ServerConfig(host=a.host, port=a.port, metrics_port=a.metrics_port),
            pool=PoolConfig(
                strategies=offered,
                default_strategies=defaults,
                default_draft_length=a.draft_length,
                num_threads=a.draft_threads,
            ),
            self_draft=SelfDraftConfig(early_exit_layers=a.early_exit_layers, skipped_layers=_ints(a.skipped_layers)),
            primary_address=a.primary_address,
            attach_poll_s=a.attach_poll_s,
            max_context=a.max_context,
            num_torch_threads=a.num_threads,
            log_level=a.log_level.upper(),
            model_path=a.model_path or None,
            cache_dir=Path(a.cache_dir),
            corpus=corpus_config(a),
            feature_drafter=Path(a.feature_drafter),
            service_token_file=a.service_token_file,
            is_unauthenticated_allowed=a.allow_unauthenticated,
        )
    except ValueError as e:
        p.error(str(e))  # exits with status 2 and the message: a configuration error is not a crash
