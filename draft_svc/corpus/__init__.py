"""The corpus decoder's index: which text (sources.py), the backward suffix array and its query
(suffix_array.py), the files on disk and their cache (store.py), and `python -m draft_svc.corpus
build` (__main__.py). The decoder itself is draft_svc/strategies/corpus.py."""
