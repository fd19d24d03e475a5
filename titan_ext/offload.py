"""Host memory for what a long-context step does not need on the GPU at the moment.

Two tenants, each exact (only where bytes live changes, never their values) and each moving a
tensor's storage rather than the tensor, because the optimizer, FSDP2, the checkpointer and
activation checkpointing hold references to the tensors themselves:

* `OptimizerStateOffload` (`--titan_ext.optimizer_offload`): AdamW's moments, away from each
  forward until the optimizer step;
* `LayerInputOffload` (`--titan_ext.activation_offload`): each block's input, away from the end of
  its forward until its backward.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class OptimizerStateOffload:
    """Moves every floating-point state tensor of `optimizers` to host memory before each forward of
    `model_parts` and back before each `optimizers.step()`.

    At long context the activations of one layer's backward and the optimizer's state never need the
    GPU at the same time, yet by default both stay resident: AdamW's two fp32 moments are 8 bytes per
    parameter (43 GB for the 5.4e9 parameters of `kimi_k2 bench`). With `--titan_ext.optimizer_offload`
    the moments leave the GPU when the next forward starts (a forward pre-hook on each model part) and
    come back when the optimizer steps (a step pre-hook), so the step itself and everything that reads
    the state between steps (checkpoint saves, `state_dict()`) see ordinary device tensors.

    How: each state tensor keeps its identity (the optimizer, FSDP2's DTensors and the checkpointer hold
    references to it); only its storage moves. The copy to host goes to a pinned buffer, made once per
    tensor, on a side stream that the forward does not wait for; the device storage is then resized to
    zero bytes, and the caching allocator reuses it once that copy is done (`record_stream`). The copy
    back is on the current stream right before the step. On a CPU device the same swap runs into plain
    host buffers: the storage really is released and restored, which is how the tests check it.
    What is not offloaded: the fp32 master weights and gradients (FSDP2 owns them) and AdamW's
    per-parameter `step` counters (host scalars already).
    """

    def __init__(self, optimizers: torch.optim.Optimizer, model_parts: list[torch.nn.Module]):
        # TorchTitan's OptimizersContainer steps the optimizers it holds; their state is the state
        self.inner = list(getattr(optimizers, "optimizers", [optimizers]))
        self._host = WeakIdKeyDictionary()  # a state tensor's local tensor -> its host buffer
        self._offloaded: list[torch.Tensor] = []
        self._copied: tuple[torch.cuda.Event, torch.device] | None = None
        self.offloaded_bytes = 0
        self._handles = [optimizers.register_step_pre_hook(lambda *_: self.restore())]
        for opt in self.inner:  # whatever reads or writes the state between steps sees it resident
            self._handles += [opt.register_state_dict_pre_hook(lambda *_: self.restore()),
                              opt.register_load_state_dict_pre_hook(lambda *_: self.restore())]
        self._handles += [m.register_forward_pre_hook(lambda *_: self.offload()) for m in model_parts]

    def _state_tensors(self):
        for state in (s for opt in self.inner for s in opt.state.values()):
            for value in state.values():
                if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0:
                    yield _local(value)

    def offload(self) -> None:
        """Copy each resident state tensor to its host buffer and release its device storage."""
        if self._offloaded:
            return  # a second forward before the step (gradient accumulation): already on the host
        tensors = [t for t in self._state_tensors() if t.untyped_storage().size() > 0]
        if not tensors:
            return
        device = tensors[0].device
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side) if side is not None else nullcontext():
            for t in tensors:
                host = self._host.get(t)
                if host is None:
                    host = self._host[t] = torch.empty(t.shape, dtype=t.dtype, pin_memory=side is not None)
                host.copy_(t, non_blocking=side is not None)
                if side is not None:
                    t.record_stream(side)
            self._copied = (side.record_event(), device) if side is not None else None
        for t in tensors:
            t.untyped_storage().resize_(0)
        self._offloaded = tensors
        self.offloaded_bytes = sum(h.numel() * h.element_size() for h in self._host.values())

    def restore(self) -> None:
        """Give each offloaded state tensor its device storage back, filled from its host buffer."""
        if self._copied is not None:
            event, device = self._copied
            torch.cuda.current_stream(device).wait_event(event)
            self._copied = None
        for t in self._offloaded:
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.copy_(self._host[t], non_blocking=t.device.type == "cuda")
        self._offloaded = []

    def remove(self) -> None:
        self.restore()
        for h in self._handles:
            h.remove()



class LayerInputOffload:
    """Each transformer block's input in host memory from the end of the block's forward until its
    backward starts.

    Under activation checkpointing a block keeps one tensor for its backward: its input, which the
    recomputation starts from ([tokens, dim] bf16 per layer: 1.4 GB at 98k tokens of Kimi-K2's 7168,
    86 GB over its 61 layers). That tensor is the one the checkpoint holds, so, as for the optimizer
    state, only its storage moves: a forward post-hook copies it to a pinned host buffer on a side
    stream and resizes the device storage to zero (the allocator reuses the memory once the copy is
    done); a hook on the block's output gradient, which autograd runs before the block's backward
    (and so before the recomputation), gives the storage back, filled from the buffer. Without
    checkpointing the same hooks move the block input that the block's own saved tensors share.
    Inputs that are views or share their storage with another tensor are left where they are.
    """

    def __init__(self, blocks: list[torch.nn.Module]):
        self._side: torch.cuda.Stream | None = None
        self.offloaded = 0  # inputs moved out so far (a counter the tests read)
        self._handles = [b.register_forward_hook(self._after_forward) for b in blocks]

    def _after_forward(self, _module, args, output):
        x = args[0] if args else None
        if (not torch.is_grad_enabled() or not torch.is_tensor(x) or not torch.is_tensor(output)
                or not output.requires_grad or x._base is not None
                or x.untyped_storage().nbytes() != x.numel() * x.element_size()):
            return
        local = _local(x)
        if local.device.type == "cuda":
            if self._side is None:
                self._side = torch.cuda.Stream(local.device)
            self._side.wait_stream(torch.cuda.current_stream(local.device))
            host = torch.empty_strided(local.size(), local.stride(), dtype=local.dtype, pin_memory=True)
            with torch.cuda.stream(self._side):
                host.copy_(local, non_blocking=True)
                local.record_stream(self._side)
                copied = self._side.record_event()
        else:
            host, copied = torch.empty_strided(local.size(), local.stride(), dtype=local.dtype), None
            host.copy_(local)
        local.untyped_storage().resize_(0)
        self.offloaded += 1

        def restore(grad):
            if copied is not None:
                torch.cuda.current_stream(local.device).wait_event(copied)
            # storage to storage: the tensor's version counter stays, so autograd's saved
            # references to it (a block without checkpointing) still accept it
            local.untyped_storage().resize_(host.untyped_storage().nbytes())
            local.untyped_storage().copy_(host.untyped_storage(), non_blocking=local.device.type == "cuda")
            return grad

        output.register_hook(restore)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
