"""Reciprocal rank fusion: several rankings of the same things made one (memory's keyword arms, code
context's BM25 beside its embeddings). No Django here."""
from __future__ import annotations

from typing import Iterable

RRF_K = 60  # the usual reciprocal-rank constant: a document's fused score is sum(1 / (RRF_K + rank))


def rrf(rankings: Iterable[list[int]]) -> list[tuple[int, float]]:
    """Reciprocal rank fusion of several rankings of ids: (id, fused score), best first; equal scores, the
    larger id first."""
    score: dict[int, float] = {}
    for ranking in rankings:
        for rank, fid in enumerate(ranking, start=1):
            score[fid] = score.get(fid, 0.0) + 1.0 / (RRF_K + rank)
    return sorted(score.items(), key=lambda item: (-item[1], -item[0]))
