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
from draft_svc.corpus.store import CorpusConfig
from draft_svc.pool import PoolConfig
from draft_svc.strategies.self_draft import SelfDraftConfig
from draft_svc.strategies.suffix_index import SuffixIndexConfig
from specdec import strategies
from specdec.logging import LOG_LEVELS
from specdec.model.options import DEFAULT_CACHE_DIR
from specdec.flags import NO_FIELD, Flag, listen_flags, log_level_flag, model_path_flag, names, parse_flags, values
from specdec.flags import check_num_threads
from specdec.service.auth import service_token_flags
from specdec.service.server import ServerConfig

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
    cache_dir: Path = DEFAULT_CACHE_DIR
    service_token_file: str = ""  # the shared secret callers must send, and this pool sends the primary
    is_unauthenticated_allowed: bool = False  # serve without a token (a trusted network only)

    def __post_init__(self) -> None:
        strategies.check_names(self.pool.strategies)
        if self.attach_poll_s <= 0:
            raise ValueError(f"attach_poll_s must be > 0, got {self.attach_poll_s}")
        if self.max_context < 0:
            raise ValueError(f"max_context must be >= 0, got {self.max_context}")
        check_num_threads(self.num_torch_threads)
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


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in names(text))


def _paths(text: str) -> tuple[Path, ...]:
    return tuple(Path(p) for p in names(text))


# The corpus index's flags, shared with `python -m draft_svc.corpus` (which builds the same index).
CORPUS_FLAGS = (
    model_path_flag("the model whose tokenizer grammar-forced and corpus drafts use (default: the default model)"),
    Flag("--cache_dir", str(DEFAULT_CACHE_DIR), convert=Path),
    Flag(
        "--corpus_sources",
        ",".join(SOURCES),
        is_shared=False,
        help=f"comma-separated corpus sources of the corpus decoder, of {','.join(SOURCES)} "
        "(draft_svc/corpus/sources.py); may be empty when --corpus_paths names files",
        group="corpus",
        field="sources",
        convert=names,
    ),
    Flag(
        "--corpus_paths",
        "",
        is_shared=False,
        help="comma-separated extra files or folders (.py .txt .md .rst .json) read after the sources",
        group="corpus",
        field="paths",
        convert=_paths,
    ),
    Flag(
        "--corpus_max_tokens",
        is_shared=False,
        help="the corpus budget in tokens: bounds the build time and the index size (~10 bytes a token)",
        group="corpus",
        field="max_tokens",
    ),
    Flag(
        "--corpus_cache_dir",
        "",
        is_shared=False,
        help="where corpus indexes are kept (default: --cache_dir)",
        group=NO_FIELD,
    ),
)
FLAGS = (
    *listen_flags(DEFAULT_PORT),
    log_level_flag(),
    Flag("--primary_address", help="host:port of the primary whose weights the model-based strategies run on"),
    Flag(
        "--num_threads",
        is_shared=False,
        help="torch intra-op threads (default 1; 0: torch's default)",
        field="num_torch_threads",
    ),
    *CORPUS_FLAGS,
    Flag(
        "--strategies",
        ",".join(OFFERED_STRATEGIES),
        is_shared=False,
        help=f"comma-separated strategies this pool offers, of {','.join(strategies.NAMES)}",
        group=NO_FIELD,
    ),
    Flag(
        "--default_strategies",
        "",
        is_shared=False,
        help="strategies of a request that names none (default: the model-free ones offered)",
        group=NO_FIELD,
    ),
    # SPECDEC_DRAFT_LENGTH: the gateway's variable too
    Flag("--draft_length", group="pool", field="default_draft_length"),
    # SPECDEC_DRAFT_THREADS
    Flag("--draft_threads", help="threads running one step's decoders in parallel", group="pool", field="num_threads"),
    Flag(
        "--early_exit_layers",
        is_shared=False,
        help="layers the early-exit decoder runs (0: 3/4 of the model's)",
        group="self_draft",
    ),
    Flag(
        "--skipped_layers",
        "",
        is_shared=False,
        help="comma-separated layers the layer-skip decoder skips (default: every other one from L/4 to 2L/3)",
        group="self_draft",
        convert=_ints,
    ),
    Flag(
        "--feature_drafter",
        str(DEFAULT_FEATURE_DRAFTER),
        is_shared=False,
        help="the feature decoder's drafter file (draft_svc/heads/file.py); when it is missing or was trained "
        "for another model the pool serves without the feature strategy",
        convert=Path,
    ),
    Flag("--max_context", is_shared=False),
    Flag("--attach_poll_s", is_shared=False),
    *service_token_flags(),
)
CONFIGS = {
    "": DraftConfig,
    "server": ServerConfig,
    "pool": PoolConfig,
    "self_draft": SelfDraftConfig,
    "corpus": CorpusConfig,
}


def corpus_config(a: argparse.Namespace) -> CorpusConfig:
    return CorpusConfig(cache_dir=Path(a.corpus_cache_dir or a.cache_dir), **values(a, CORPUS_FLAGS, "corpus"))


def pool_config(a: argparse.Namespace) -> PoolConfig:
    """The pool's strategies: those offered, and those of a request that names none (the model-free
    ones offered, else all offered)."""
    offered = names(a.strategies)
    defaults = names(a.default_strategies) or tuple(n for n in offered if n in MODEL_FREE_STRATEGIES) or offered
    return PoolConfig(strategies=offered, default_strategies=defaults, **values(a, FLAGS, "pool"))


def from_args(argv: Sequence[str] | None, environ: Mapping[str, str]) -> DraftConfig:
    p = argparse.ArgumentParser(prog="python -m draft_svc", description="The draft pool service.")
    a = parse_flags("DRAFT", environ, FLAGS, CONFIGS, p, argv)
    try:
        return DraftConfig(
            server=ServerConfig(**values(a, FLAGS, "server")),
            pool=pool_config(a),
            self_draft=SelfDraftConfig(**values(a, FLAGS, "self_draft")),
            corpus=corpus_config(a),
            **values(a, FLAGS),
        )
    except ValueError as e:
        p.error(str(e))  # exits with status 2 and the message: a configuration error is not a crash
