"""One data-parallel rank on CPU under a 16-bit policy: FSDP's casts without FSDP's copies.

FSDP2 at one rank still runs its whole unshard for every unit, forward and (resharded units)
backward: the fp32 parameters cast into a fresh 16-bit buffer, copied into the all-gather buffer,
"gathered" (gloo copies the buffer onto itself) and copied out into the unsharded parameters, then
every gradient copied into a reduce buffer: 0.07-0.19 s of FSDP hooks in profiled dense_small bf16
steps on 2 CPU cores (~1.9-2.2 s).

``OneRankCast`` computes exactly what FSDP computes there, with one cast per parameter and one per
gradient:

- at the model's forward, every parameter's storage is swapped for its 16-bit cast (written into a
  buffer kept from step to step), so the modules (and the head inside the loss) see the same 16-bit
  leaf parameters FSDP's unsharded ones are, and autograd sums a parameter's uses in 16 bits as it
  does for those;
- each gradient, as autograd finishes it, is taken off the parameter and added in fp32 to the
  step's accumulated gradient (the first one cast): FSDP's accumulation in its reduce dtype, in the
  same order, micro-batch by micro-batch;
- at the end of each backward (and after a forward that will have none) the fp32 storage is put
  back and the accumulated gradient becomes ``.grad``, so the optimizer, clipping, checkpoints and
  exports see fp32 parameters and gradients as at any other time;
- every unit FSDP would have wrapped (each block, the root) casts its floating-point inputs to the
  16-bit dtype, as FSDP's ``cast_forward_inputs`` does.

Gradients and the step's loss equal FSDP's at one rank bitwise (``tests/test_one_rank_cast.py``). What
differs is memory: the 16-bit copy of every parameter is held for the whole step (FSDP frees a
block's after its forward and backward), which on CPU is cheap next to the activations; GPU runs keep
FSDP. ``train.mixed_precision.one_rank_cast=false`` keeps FSDP on CPU too.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.utils import _apply_to_tensors

if TYPE_CHECKING:
    from hyperpar.distributed.parallel_dims import ParallelDims

_ATTR = "_hyperpar_one_rank_cast"


def _cast_fp(dtype: torch.dtype, x: Any) -> Any:
    if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
        return x.to(dtype)
    return x


class OneRankCast:
    """The parameters of ``model`` in ``dtype`` for each forward and backward, fp32 between them."""

    def __init__(self, model: nn.Module, units: Iterable[nn.Module], dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.params: list[nn.Parameter] = []  # tied weights once; taken at the first forward (after materialising)
        self.masters: list[torch.Tensor] = []  # the fp32 storages while the casts are in
        self.casts: list[torch.Tensor] = []  # 16-bit buffers, allocated at the first forward
        self.grads: dict[nn.Parameter, torch.Tensor] = {}  # this step's fp32 gradients, while active
        self.active = False
        self._restore_queued = False
        self._hooked: set[nn.Parameter] = set()
        self._cast_inputs = functools.partial(_cast_fp, dtype)
        for unit in (*units, model):
            unit.register_forward_pre_hook(self._unit_pre_forward, prepend=True, with_kwargs=True)
            unit.register_forward_hook(self._unit_post_forward)
        model.register_forward_pre_hook(self._root_pre_forward, prepend=True)
        model.register_forward_hook(self._root_post_forward, always_call=True)
        setattr(model, _ATTR, self)

    # -- the swap -------------------------------------------------------------------------------

    @torch.no_grad()
    def cast_in(self) -> None:
        if self.active:
            return
        params = list(dict.fromkeys(self.model.parameters()))
        if len(params) != len(self.params) or any(a is not b for a, b in zip(params, self.params)):
            # the first forward, or the parameters were replaced (materialised from meta, loaded)
            for p in params:
                if p not in self._hooked:
                    p.register_post_accumulate_grad_hook(self._take_grad)
                    self._hooked.add(p)
            self.params = params
            self.casts = [torch.empty(p.shape, dtype=self.dtype, device=p.device) for p in params]
        self.masters = [p.data for p in self.params]
        torch._foreach_copy_(self.casts, self.masters)
        for p, cast in zip(self.params, self.casts):
            if p.grad is not None:  # a gradient from before this step: the fp32 sum goes on from it
                self.grads[p] = p.grad
                p.grad = None
            p.data = cast
        self.active = True

    def restore(self) -> None:
        """fp32 parameters back, the step's accumulated gradients as their ``.grad``."""
        self._restore_queued = False
        if not self.active:
            return
        for p, master in zip(self.params, self.masters):
            p.data = master
            p.grad = self.grads.pop(p, None)
        self.masters = []
        self.grads.clear()
        self.active = False

    def _take_grad(self, p: torch.Tensor) -> None:
        if not self.active or p.grad is None:
            return
        g, p.grad = p.grad, None
        acc = self.grads.get(p)
        if acc is None:
            self.grads[p] = g.to(torch.float32)
        else:
            acc.add_(g)

    # -- hooks ----------------------------------------------------------------------------------

    @torch.compiler.disable
    def _root_pre_forward(self, module: nn.Module, args: tuple) -> None:
        self.cast_in()

    @torch.compiler.disable
    def _root_post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        # A forward with no backward to come (no grad, frozen weights, or one that raised) puts the
        # fp32 parameters back at once; else the first unit whose output's gradient arrives queues it.
        if not (torch.is_grad_enabled() and self._needs_grad(output)):
            self.restore()

    @torch.compiler.disable
    def _unit_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _apply_to_tensors(self._cast_inputs, args), _apply_to_tensors(self._cast_inputs, kwargs)

    @torch.compiler.disable
    def _unit_post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if torch.is_grad_enabled():
            def hook(t: torch.Tensor) -> torch.Tensor:
                if t.requires_grad and t.grad_fn is not None:  # not a parameter (the fused head hands its weight on)
                    t.register_hook(self._pre_backward)
                return t

            _apply_to_tensors(hook, output)
        return output

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.active and not self._restore_queued:
            self._restore_queued = True
            Variable._execution_engine.queue_callback(self.restore)

    @staticmethod
    def _needs_grad(output: Any) -> bool:
        found = []
        _apply_to_tensors(lambda t: found.append(t.requires_grad) or t, output)
        return any(found)


def planned(pdims: ParallelDims, param_dtype: torch.dtype, reduce_dtype: torch.dtype, enabled: bool, device_type: str | None) -> bool:
    """Whether a layout gets ``OneRankCast`` (what ``fsdp.apply_fsdp`` decides from the built model):
    one data-parallel CPU rank with no tp, cp, ep or pp, fp32 parameters and reduction, 16-bit compute."""
    return (enabled and device_type == "cpu" and reduce_dtype == torch.float32 and param_dtype != reduce_dtype
            and pdims.fsdp_size == 1 and pdims.dp == 1 and pdims.tp == 1 and pdims.pp == 1 and pdims.ep == 1)


def one_rank_cast_of(model: nn.Module) -> OneRankCast | None:
    return getattr(model, _ATTR, None)


def settle(parts: Iterable[nn.Module]) -> None:
    """fp32 parameters and gradients in every part (a no-op unless a forward's casts are still in)."""
    for part in parts:
        cast = one_rank_cast_of(part)
        if cast is not None:
            cast.restore()
