"""`python -m draft_svc.corpus build`: build (or find) the corpus decoder's index ahead of time.

    python -m draft_svc.corpus build [--corpus_sources docs,json,python] [--corpus_paths DIR,...]
                                     [--corpus_max_tokens 2097152] [--corpus_cache_dir D]
                                     [--model_path M] [--cache_dir D]
    python -m draft_svc.corpus query --text "import numpy as"

Takes the draft service's flags and SPECDEC_* environment (draft_svc/config.py), so it builds the
very index the service would otherwise build on its first start; prints where it is and what it
holds (tokens, bytes, build time) as one JSON object. `query` prints the drafts for a text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence

from draft_svc.config import CONFIGS, CORPUS_FLAGS, corpus_config
from draft_svc.corpus.store import index_dir, open_index
from specdec.logging import configure_logging
from specdec.model.loader import resolve_model_dir
from specdec.model.tokenizer import Tokenizer
from specdec.flags import add_flags
from specdec.service.flags import Flags
from specdec.flag_spellings import add_spellings


def main(argv: Sequence[str] | None, environ: Mapping[str, str]) -> int:
    p = argparse.ArgumentParser(prog="python -m draft_svc.corpus", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("build", "query"))
    add_flags(Flags(p, "DRAFT", environ), CORPUS_FLAGS, CONFIGS)
    p.add_argument("--text", default="", help="query: the context whose drafts are printed")
    p.add_argument("--max_tokens", type=int, default=8, help="query: tokens per draft")
    p.add_argument("--max_candidates", type=int, default=3, help="query: drafts")
    a = add_spellings(p).parse_args(argv)
    try:
        config = corpus_config(a)
    except ValueError as e:
        p.error(str(e))
    if a.max_tokens < 1 or a.max_candidates < 1:
        p.error("--max_tokens and --max_candidates must be >= 1")
    configure_logging("corpus", level="WARNING")
    model_dir = resolve_model_dir(a.model_path, a.cache_dir, show_progress=sys.stderr.isatty())
    assert config.cache_dir is not None  # corpus_config always sets it
    path, _ = index_dir(config, model_dir, config.cache_dir)
    was_cached = path.is_dir()
    started = time.perf_counter()
    index = open_index(config, model_dir, config.cache_dir, show_progress=True)
    if a.command == "build":
        print(
            json.dumps(
                {
                    "path": str(index.path),
                    "was_cached": was_cached,
                    "num_bytes": index.num_bytes,
                    "open_s": round(time.perf_counter() - started, 2),
                    **index.meta,
                },
                indent=1,
            )
        )
        return 0
    tokenizer = Tokenizer.from_dir(model_dir)
    context = tokenizer.encode(a.text)
    started = time.perf_counter()
    drafts = index.suffix_array.query(context, a.max_tokens, a.max_candidates)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    for rank, draft in enumerate(drafts):
        print(f"#{rank} {tokenizer.decode(list(draft))!r}")
    print(f"({len(drafts)} drafts in {elapsed_ms:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], os.environ))
