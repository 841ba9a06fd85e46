"""A workload for the benchmarks: the built-in transformer with a 32768-token vocabulary
and untied embeddings, so its token embedding (32768 x 128, 16 MB) is a large, row-sparse
gradient (a batch of 8 x 64 tokens touches at most 512 of its rows), as in language
models with large vocabularies. Its LM head stays dense.

    autotune bench --workload bench/workloads/large_vocab.py:make
"""

from __future__ import annotations

import dataclasses

from autotune.workloads import Workload, transformer


def make() -> Workload:
    return dataclasses.replace(transformer(vocab=32768, tie_weights=False), name="large_vocab")
