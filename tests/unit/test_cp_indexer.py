"""The indexer's key-chunked running top-k (the path context parallel runs) against a dense top-k."""

import torch

from titan_ext.models.context_parallel import Segment, flat_segments, segment_positions, segments_of
from titan_ext.models.glm5.dsa import _index_scores, indexer_topk


def test_segments_follow_head_tail_positions():
    pos = [4, 5, 6, 7, 24, 25, 26, 27]
    assert segments_of(pos) == (Segment(0, 4, 4), Segment(4, 24, 4))
    assert segment_positions(flat_segments(segments_of(pos)), "cpu").tolist() == pos


def test_running_top_k_over_key_chunks_selects_what_a_dense_top_k_selects():
    gen = torch.Generator().manual_seed(0)
    segments, seq, topk = [0, 16, 16, 16, 96, 16], 128, 12  # rank 1 of CP=4 on 128 tokens
    # 8 heads, positive mixing weights: exact ties (every head's ReLU zero) are rare enough not
    # to reach any query's top-12 here, so the selected sets are unique
    q = torch.randn(2, 32, 8, 16, generator=gen)
    k = torch.randn(2, seq, 16, generator=gen)
    w = torch.rand(2, 32, 8, generator=gen)
    pos = segment_positions(segments, "cpu")
    dense = _index_scores(q, k, w, seq, 0, 0.25)  # queries "after" every key: nothing masked yet
    dense = dense.masked_fill(torch.arange(seq)[None, :] > pos[:, None], float("-inf")).topk(topk, dim=-1)
    got = indexer_topk(q, k, w, topk, segments, 8, 20, 0.25)  # 2 query chunks per segment, 7 key chunks

    def visible(idx):
        return torch.where(idx <= pos[None, :, None], idx, -1).sort(-1).values

    assert torch.equal(visible(got), visible(dense.indices))
    assert (visible(got) >= 0).sum(-1).min() == topk  # every query here sees more than top-k keys
