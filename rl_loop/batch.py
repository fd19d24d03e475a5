"""Pack scored rollouts into one training batch; reject samples that cannot be replayed.

A sample whose routing record does not fit its tokens (wrong number of rows,
layers or top-k, expert ids out of range) would either crash the trainer's
forward or, worse, replay garbage. Such a sample is dropped from the batch with
the reason, the rest of the step goes on, and the caller logs the count.

A reason reads ``"<kind>: <detail>"``: the kind is short and from a fixed set
(``reason_kind``), so per-step counts by kind stay a handful of keys; a sample
the server returned without routing is ``no routing record (<server's reason>)``
(``vllm_ext.routing.missing``), with the server's message as the detail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Sample:
    """One completion: token ids, the inference engine's logprobs, its routing and its reward."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    reward: float
    group: int
    policy_version: int = 0
    routing: np.ndarray | None = None  # [len(prompt) + len(completion) - 1, moe layers, top_k]
    advantage: float = 0.0
    # Multi-turn: 1 for tokens the model sampled, 0 for the environment's tokens between turns
    # (in the sequence and its routing, not in the loss; their logprobs are placeholders). None: all 1.
    completion_mask: list[int] | None = None
    error: str | None = None  # set by the task when the rollout failed (e.g. an environment error): rejected
    routing_error: str | None = None  # the server's "<reason>: <detail>" when it returned no routing
    # The DSA indexer's keys of the same rows ([rows, indexer layers, index top-k], -1 in empty slots), when
    # the replicas capture them (`train.replay_indexer`).
    index_keys: np.ndarray | None = None


@dataclass(frozen=True)
class ModelShape:
    num_moe_layers: int
    top_k: int
    num_experts: int
    # Indexer replay (`train.replay_indexer`): the DSA layers and their top-k; 0 when off.
    index_layers: int = 0
    index_topk: int = 0

    @classmethod
    def of(cls, arch, index_keys: bool = False) -> ModelShape:
        """The shape of a titan_ext arch's records; with `index_keys`, its indexer keys' too."""
        return cls(len(arch.moe_layer_ids), arch.top_k, arch.num_experts,
                   arch.n_layers if index_keys else 0, arch.index_topk if index_keys else 0)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S] int64, right padded
    mask: torch.Tensor  # [B, S-1] bool: targets that are sampled completion tokens (holes at environment tokens)
    logp_infer: torch.Tensor  # [B, S-1] float32
    advantages: torch.Tensor  # [B, 1] float32
    replay_ids: torch.Tensor | None  # [B, S-1, L, K] int64
    policy_versions: list[int] = field(default_factory=list)
    replay_keys: torch.Tensor | None = None  # [B, S-1, indexer layers, index top-k] int64 (`titan_ext.replay`)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("tokens", "mask", "logp_infer", "advantages", "replay_ids",
                                              "policy_versions", "replay_keys")}

    @classmethod
    def from_dict(cls, d: dict) -> "Batch":
        return cls(**d)

    def shard(self, rank: int, world: int) -> "Batch":
        """This data-parallel rank's rows; the replay ids travel with their tokens."""
        sl = slice(rank, None, world)
        return Batch(self.tokens[sl], self.mask[sl], self.logp_infer[sl], self.advantages[sl],
                     None if self.replay_ids is None else self.replay_ids[sl], self.policy_versions[sl],
                     None if self.replay_keys is None else self.replay_keys[sl])

    def padded(self, multiple: int) -> "Batch":
        """The batch with its S-1 model inputs padded to a multiple of `multiple` (context parallel's
        head-tail layout cuts a sequence into 2 * cp equal chunks). Padded targets are out of the
        loss (mask 0); padded positions repeat the last token, its expert ids and its indexer keys,
        which are valid there, and causal attention keeps them from touching the real tokens before them."""
        extra = -(self.tokens.size(1) - 1) % multiple
        if not extra:
            return self

        def repeat_last(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x[:, -1:].expand(-1, extra, *x.shape[2:])], dim=1)

        def zeros(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros(x.size(0), extra, *x.shape[2:])], dim=1)

        return Batch(repeat_last(self.tokens), zeros(self.mask), zeros(self.logp_infer), self.advantages,
                     None if self.replay_ids is None else repeat_last(self.replay_ids), self.policy_versions,
                     None if self.replay_keys is None else repeat_last(self.replay_keys))


def reason_kind(reason: str) -> str:
    """The bounded part of a rejection reason (before the first ': '), which per-step metrics count by."""
    return reason.split(": ", 1)[0]


def routing_error(sample: Sample, shape: ModelShape) -> str | None:
    """Why `sample.routing` cannot be replayed on its tokens, or None when it can."""
    r = sample.routing
    if r is None:
        if sample.routing_error:
            return f"no routing record ({reason_kind(sample.routing_error)}): {sample.routing_error}"
        return "no routing record"
    rows = len(sample.prompt_ids) + len(sample.completion_ids) - 1
    if r.ndim != 3:
        return f"routing record does not fit: {r.ndim} dimensions, expected 3 (rows, layers, top_k)"
    if r.shape != (rows, shape.num_moe_layers, shape.top_k):
        return (f"routing record does not fit: shape {tuple(r.shape)}, expected "
                f"{(rows, shape.num_moe_layers, shape.top_k)} (prompt+completion-1 rows, MoE layers, top_k)")
    if r.size and (int(r.min()) < 0 or int(r.max()) >= shape.num_experts):
        return (f"routing record does not fit: expert ids outside [0, {shape.num_experts}): "
                f"min {int(r.min())}, max {int(r.max())}")
    if shape.index_topk:
        return index_keys_error(sample.index_keys, rows, shape)
    return None


def index_keys_error(keys: np.ndarray | None, rows: int, shape: ModelShape) -> str | None:
    """Why a sample's indexer keys cannot be replayed on its `rows` positions, or None when they can
    (the codec has checked each row's keys against its position)."""
    if keys is None:
        return ("no indexer keys: the replicas did not capture them (train.replay_indexer starts them with "
                "MOERL_INDEXER_KEYS=1; a replica started otherwise sends none)")
    want = (rows, shape.index_layers, shape.index_topk)
    if keys.shape != want:
        return (f"indexer keys do not fit: shape {tuple(keys.shape)}, expected {want} (prompt+completion-1 rows, "
                "indexer layers, index top-k): the served checkpoint's index_topk or layers differ from the trainer's")
    return None


def dense_index_keys(keys: np.ndarray) -> torch.Tensor:
    """Indexer keys as the trainer's selection reads them: the empty slots (-1) of rows below top-k
    hold their column index instead, a key past the query that the attention masks, as the trainer's
    own top-k leaves there."""
    cols = np.arange(keys.shape[-1])
    return torch.from_numpy(np.where(keys < 0, cols, keys).astype(np.int64))


def pack(samples: list[Sample], shape: ModelShape | None, pad_id: int) -> tuple[Batch | None, list[tuple[int, str]]]:
    """Pack samples; with `shape` (replay on) samples whose record does not fit are rejected.

    Returns the batch (None when nothing is left) and (index, reason) per rejected sample
    (``"<kind>: <detail>"``, see ``reason_kind``).
    """
    rejected: list[tuple[int, str]] = []
    kept: list[Sample] = []
    for i, s in enumerate(samples):
        reason = None
        if s.error:
            reason = f"rollout failed: {s.error}"
        elif len(s.logprobs) != len(s.completion_ids):
            reason = (f"logprobs do not match the completion: {len(s.logprobs)} logprobs for "
                      f"{len(s.completion_ids)} completion tokens")
        elif not s.completion_ids:
            reason = "empty completion"
        elif s.completion_mask is not None and len(s.completion_mask) != len(s.completion_ids):
            reason = (f"completion mask does not match the completion: mask of {len(s.completion_mask)} for "
                      f"{len(s.completion_ids)} completion tokens")
        elif s.completion_mask is not None and not any(s.completion_mask):
            reason = "no sampled token in the completion (mask all 0)"
        elif shape is not None:
            reason = routing_error(s, shape)
        if reason:
            rejected.append((i, reason))
        else:
            kept.append(s)
    if not kept:
        return None, rejected
    seq = max(len(s.prompt_ids) + len(s.completion_ids) for s in kept)
    b = len(kept)
    tokens = torch.full((b, seq), pad_id, dtype=torch.int64)
    mask = torch.zeros(b, seq - 1, dtype=torch.bool)
    logp = torch.zeros(b, seq - 1, dtype=torch.float32)
    replay = keys = None
    if shape is not None:
        # Padding rows replay experts 0..k-1 (and keys 0..k-1): causal attention keeps them from touching real tokens.
        replay = torch.arange(shape.top_k).expand(b, seq - 1, shape.num_moe_layers, shape.top_k).clone()
        if shape.index_topk:
            keys = torch.arange(shape.index_topk).expand(b, seq - 1, shape.index_layers, shape.index_topk).clone()
    for j, s in enumerate(kept):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        tokens[j, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        if s.completion_mask is None:
            mask[j, p - 1 : p + c - 1] = True
        else:
            mask[j, p - 1 : p + c - 1] = torch.tensor(s.completion_mask, dtype=torch.bool)
        logp[j, p - 1 : p + c - 1] = torch.tensor(s.logprobs, dtype=torch.float32)
        if replay is not None:
            replay[j, : p + c - 1] = torch.from_numpy(np.ascontiguousarray(s.routing).astype(np.int64))
        if keys is not None:
            keys[j, : p + c - 1] = dense_index_keys(s.index_keys)
    adv = torch.tensor([[s.advantage] for s in kept], dtype=torch.float32)
    return Batch(tokens, mask, logp, adv, replay, [s.policy_version for s in kept], keys), rejected
