"""Router replay (R3): the trainer routes each token to the experts inference chose, and (for a
DSA model, `replay_index_keys`) attends to the keys inference's indexer chose.

In MoE RL the trainer's own top-k differs from the inference engine's for a few
percent of (token, layer) pairs, so the probabilities it trains on are not the
ones that sampled the tokens. Replay feeds inference's expert ids into every MoE
router. The gate weights stay the trainer's live scores, gathered at the replayed
ids and normalised/scaled exactly as TorchTitan does, so the gate still learns;
the load-balancing bias only affects selection and so plays no part.

The decoder forward takes no extra arguments, so ids reach the routers through a
side channel: `replay_routing(model, ids)` sets each MoE layer's slice for the
duration of one forward (and its backward, which reuses saved tensors). The ids
must be laid out exactly like the tokens given to that forward on that rank,
`[batch, seq, num_moe_layers, top_k]`; under data parallel / FSDP2 and expert
parallel each rank passes the rows of its own tokens (the all-to-all dispatch
happens after routing); under context parallel a rank's tokens are also a subset of
the sequence's positions, and `shard_replay_ids` takes a full-sequence record's rows for
them with the layout the trainer gives the tokens. This module takes plain integer
tensors and knows no wire format: decoding routing records is the RL loop's job.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torchtitan.config import derive, override
from torchtitan.models.common.moe import TokenChoiceTopKRouter


class ReplayRecordError(ValueError):
    """Recorded expert ids that cannot be replayed on this batch (shape or range)."""


class ReplayRouter(TokenChoiceTopKRouter):
    """TorchTitan's top-k router, replaying recorded ids whenever the side channel holds some."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.replay_ids_BLK: torch.Tensor | None = None
        # Side channel too (`replay_routing`): padding positions, and the expert load their MoE counts.
        self.padding_BL: torch.Tensor | None = None
        self.load_E: torch.Tensor | None = None
        # Kept on the device: reading it in forward would stall the GPU once per layer.
        self._disagreement: torch.Tensor | None = None

    @property
    def disagreement(self) -> float | None:
        """Fraction of tokens whose own top-k set differed from the replayed one (last replayed forward)."""
        return None if self._disagreement is None else float(self._disagreement)

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        own_scores_BLK, own_ids_BLK, scores_BLE = super().forward(x_BLD, expert_bias_E)
        ids_BLK = self.replay_ids_BLK
        if ids_BLK is None:
            self._uncount_padding(own_ids_BLK, scores_BLE)
            return own_scores_BLK, own_ids_BLK, scores_BLE
        if ids_BLK.shape != own_ids_BLK.shape:
            raise ReplayRecordError(
                f"replayed ids have shape {tuple(ids_BLK.shape)} but this layer routes "
                f"{tuple(own_ids_BLK.shape)} (batch, seq, top_k)"
            )
        ids_BLK = ids_BLK.to(device=own_ids_BLK.device, dtype=own_ids_BLK.dtype).contiguous()
        with torch.no_grad():
            differs = (own_ids_BLK.sort(dim=-1).values != ids_BLK.sort(dim=-1).values).any(dim=-1)
            self._disagreement = (differs if self.padding_BL is None else differs[~self.padding_BL]).float().mean()
        self._uncount_padding(ids_BLK, scores_BLE)
        topk_scores_BLK = scores_BLE.gather(dim=-1, index=ids_BLK)
        if self.route_norm:
            topk_scores_BLK = topk_scores_BLK / (topk_scores_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_scores_BLK * self.route_scale, ids_BLK, scores_BLE

    def _uncount_padding(self, ids_BLK: torch.Tensor, scores_BLE: torch.Tensor) -> None:
        """Take the padding's experts out of the load its MoE is about to count (the load-balancing
        bias update's input): the MoE adds every routed position, this subtracts the padded ones first."""
        if self.padding_BL is None or self.load_E is None or not self.training:
            return
        with torch.no_grad():
            chosen_BLE = torch.zeros_like(scores_BLE, dtype=torch.bool).scatter_(-1, ids_BLK, True)
            self.load_E.sub_(chosen_BLE[self.padding_BL].sum(0).to(self.load_E.dtype))


@override(
    target=TokenChoiceTopKRouter.Config,
    exact=True,
    description="Router replay: route by recorded expert ids when given.",
)
def replay_router(cfg: TokenChoiceTopKRouter.Config) -> ReplayRouter.Config:
    """titan_ext's models are built with it; stock TorchTitan configs get it with
    `--override.imports titan_ext.replay.replay_router`."""
    return derive(cfg, ReplayRouter.Config)


def moe_routers(model: torch.nn.Module) -> list[ReplayRouter]:
    """The model's replaying routers, in layer order (one per MoE layer)."""
    return [m for m in model.modules() if isinstance(m, ReplayRouter)]


def check_replay_ids(ids: torch.Tensor, *, tokens_shape: tuple[int, int], num_moe_layers: int,
                     top_k: int, num_experts: int) -> None:
    """Raise ReplayRecordError saying what is wrong with `ids` for a batch of `tokens_shape`."""
    want = (*tokens_shape, num_moe_layers, top_k)
    _check_integers(ids, "expert ids")
    if tuple(ids.shape) != want:
        raise ReplayRecordError(
            f"expert ids have shape {tuple(ids.shape)}, expected {want} "
            "(batch, seq, moe layers, top_k): the record does not belong to these tokens or this model"
        )
    _check_range(ids, num_experts, "expert ids must lie in")


def _check_integers(t: torch.Tensor, what: str) -> None:
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ReplayRecordError(f"{what} must be integers, got {t.dtype}")


def _check_range(t: torch.Tensor, end: int, what: str) -> None:
    """ReplayRecordError unless every value of `t` lies in [0, end)."""
    if t.numel():
        lo, hi = torch.stack(torch.aminmax(t)).tolist()  # one host sync per batch, not two
        if lo < 0 or hi >= end:
            raise ReplayRecordError(f"{what} [0, {end}); got min {lo}, max {hi}")


def shard_replay_ids(model: torch.nn.Module, ids_BSNK: torch.Tensor) -> torch.Tensor:
    """This rank's positions of a full-sequence record `[batch, seq, num_moe_layers, top_k]` when
    `model` runs context parallel (the layout its tokens get), else the record itself."""
    from .models.context_parallel import sequence_shards

    shards = sequence_shards(model)
    return ids_BSNK if shards is None else shards.shard(ids_BSNK)[0]


@contextmanager
def replay_routing(model: torch.nn.Module, ids_BLNK: torch.Tensor | None,
                   padding_BL: torch.Tensor | None = None) -> Iterator[list[ReplayRouter]]:
    """Replay `ids_BLNK` ([batch, seq, num_moe_layers, top_k]) in the forwards run inside this block.

    `None` runs the model's own routing (and still yields the routers). The ids are
    checked against the model before anything runs. `padding_BL` ([batch, seq] bool, laid
    out like the ids) marks positions that only pad the sequence (context parallel's equal
    chunks): their experts count neither in the MoE's expert load nor in the disagreement.
    """
    routers = moe_routers(model)
    if padding_BL is not None:
        for moe in model.modules():
            if isinstance(getattr(moe, "router", None), ReplayRouter):
                moe.router.padding_BL, moe.router.load_E = padding_BL, moe.tokens_per_expert_E
    if ids_BLNK is not None:
        if not routers:
            raise ReplayRecordError("the model has no replaying routers: activate titan_ext.replay.replay_router")
        first = routers[0]
        check_replay_ids(ids_BLNK, tokens_shape=tuple(ids_BLNK.shape[:2]), num_moe_layers=len(routers),
                         top_k=first.top_k, num_experts=first.num_experts)
        for i, router in enumerate(routers):
            router.replay_ids_BLK = ids_BLNK[:, :, i, :]
    try:
        yield routers
    finally:
        for router in routers:
            router.replay_ids_BLK = router.padding_BL = router.load_E = None


def disagreement_by_layer(routers: list[ReplayRouter]) -> list[float | None]:
    """Per MoE layer, the fraction of tokens whose own choice differed from the replayed one."""
    return [r.disagreement for r in routers]


def check_replay_keys(keys: torch.Tensor, *, seq_len: int, num_layers: int, topk: int) -> None:
    """Raise ReplayRecordError saying what is wrong with indexer keys `[batch, seq, layers, topk]`
    for sequences of `seq_len` positions (a key is a position of the same sequence)."""
    _check_integers(keys, "indexer keys")
    if keys.dim() != 4 or tuple(keys.shape[2:]) != (num_layers, topk):
        raise ReplayRecordError(
            f"indexer keys have shape {tuple(keys.shape)}, expected [batch, seq, {num_layers}, {topk}] (indexer "
            "layers, index top_k): the record does not belong to this model"
        )
    # rows below top-k (and padding) hold column indices past the query: up to topk - 1
    _check_range(keys, max(seq_len, topk), "indexer keys must be positions in")


@contextmanager
def replay_index_keys(model: torch.nn.Module, keys_BLNK: torch.Tensor | None,
                      seq_len: int | None = None) -> Iterator[list]:
    """Replay the indexer keys `keys_BLNK` ([batch, seq, indexer layers, index top_k], this rank's
    positions: `shard_replay_ids` shards them as expert ids) in the forwards run inside this block.

    `None` lets the indexers choose. `seq_len` (the whole sequence's, under context parallel)
    bounds the keys; it defaults to the keys' own length."""
    from .models.glm5.dsa import indexers_of

    indexers = indexers_of(model)
    if keys_BLNK is not None:
        if not indexers:
            raise ReplayRecordError("indexer keys given, but the model has no DSA indexer (GLM-5 has)")
        check_replay_keys(keys_BLNK, seq_len=seq_len or keys_BLNK.size(1), num_layers=len(indexers),
                          topk=indexers[0].topk)
        for i, m in enumerate(indexers):
            m.replay_keys_BLK = keys_BLNK[:, :, i, :]
    try:
        yield indexers
    finally:
        for m in indexers:
            m.replay_keys_BLK = None
