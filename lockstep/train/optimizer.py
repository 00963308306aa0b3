"""AdamW over fp32 master weights, with optional optimiser-state offload to CPU.

The model may compute in bf16; the optimiser keeps, per parameter p, an fp32 master copy w and
the moments m, v, and after each update writes w back into p (rounded to p's dtype). For an fp32
parameter that is not offloaded, w is p itself (no copy). Update for step t (torch.optim.AdamW's
order of operations, so the two agree to rounding), with g the (clipped) gradient in fp32:

    w <- w * (1 - lr * wd)                       decoupled weight decay; wd = 0 for 1-D tensors
    m <- b1 m + (1 - b1) g                       (norms, biases, router bias), as Megatron does
    v <- b2 v + (1 - b2) g^2
    w <- w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Gradient clipping: total = || all grads ||_2; if total > max_norm every gradient is divided by
(total + 1e-6) / max_norm. A non-finite total skips the update (nothing changes, gradients are
cleared) and `step` reports it. The norm, the clipping and the skip are worked out on the
gradients' device (`launch`) and read back once the update is queued (`finish`): a one-process CUDA
step queues its optimiser behind the backward instead of waiting for it to end. The squares are
summed in fp64 and the norm rounded to fp32, so the total does not depend (short of an fp64
rounding landing on an fp32 rounding boundary) on how the sum was split: over parameters here, over
FSDP shards across ranks (`data_parallel`: the squares of sharded (DTensor) gradients are summed
over ranks, those of replicated ones counted once).

FSDP2 (lockstep/dist/fsdp.py): a parameter may be a DTensor whose local shard is this rank's part
of the fp32 master; the update runs on the local shards, elementwise, so N ranks together compute
what one process computes on the full tensors.

Offload (`offload=True`): w, m, v live on the CPU (pinned when CUDA is present); each update
moves one parameter's state to the parameter's device, updates it there and copies it back, so
the accelerator holds at most one tensor's optimiser state at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor

from lockstep.train import adamw_triton
from lockstep.train.data_parallel import DataParallel, full_tensor, local_part


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's sharded parameters and gradients); a tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Slot:
    param: torch.nn.Parameter
    master: torch.Tensor  # fp32; the parameter's (local) tensor itself when fp32 and not offloaded
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: bool
    aliased: bool


@dataclass
class PendingStep:
    """A launched optimiser step: [grad norm, skipped (1.0) or not (0.0)] where the gradients were."""
    result: torch.Tensor


def _groups(slots: list[_Slot]) -> list[list[_Slot]]:
    """Slots by (device, decay): one fused update each."""
    groups: dict[tuple, list[_Slot]] = {}
    for s in slots:
        groups.setdefault((s.param.device, s.decay), []).append(s)
    return list(groups.values())


class MasterAdamW:
    """AdamW with fp32 master weights. `named_params`: (name, parameter) pairs; names key the state."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], *, lr: float = 1e-6,
                 betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8, weight_decay: float = 0.0,
                 offload: bool = False, data_parallel: DataParallel | None = None, triton: bool | None = False):
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.offload = offload
        self.triton = triton  # the update as adamw_triton's multi-tensor kernel where it runs
        self.dp = data_parallel or DataParallel()
        # sums the fp64 total of squares over the ranks holding the model's other parameters (pipeline
        # stages: lockstep.dist.pipeline_parallel sets it); None: this rank's parameters are the model's
        self.stage_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.step_count = 0
        self.slots: dict[str, _Slot] = {}
        for name, p in named_params:
            if p.requires_grad and name not in self.slots:
                self.slots[name] = self._make_slot(p)

    def _make_slot(self, p: torch.nn.Parameter) -> _Slot:
        local = _local(p.detach())
        aliased = not self.offload and p.dtype == torch.float32
        if self.offload:
            pin = torch.cuda.is_available()
            master = local.to("cpu", torch.float32, copy=True)
            master = master.pin_memory() if pin else master
        elif aliased:
            master = local
        else:
            master = local.float().clone()
        zeros = lambda: torch.zeros_like(master, memory_format=torch.preserve_format).detach()  # noqa: E731
        return _Slot(p, master, zeros(), zeros(), decay=p.dim() >= 2, aliased=aliased)

    # ---- gradients ------------------------------------------------------------------------

    def zero_grad(self) -> None:
        for s in self.slots.values():
            s.param.grad = None

    def grad_norm(self) -> torch.Tensor:
        """Total L2 norm of all gradients (over every rank's shards), fp32 scalar on the CPU."""
        return self._grad_norm().cpu()

    def _grad_norm(self) -> torch.Tensor:
        """`grad_norm` where the gradients are: read by the host only where a collective needs it."""
        grads: dict[tuple, list[torch.Tensor]] = {}  # (sharded?, device, dtype) -> local gradients
        for s in self.slots.values():
            g = s.param.grad
            if g is not None:
                local = _local(g.detach())
                grads.setdefault((isinstance(g, DTensor), local.device, local.dtype), []).append(local)
        # per-tensor norms in fp64, read from the gradients' own dtype: a few multi-tensor launches
        # where a cast, a square and a sum took three launches per tensor. One dtype per group: a
        # group of bf16 and fp32 gradients (the parameters kept in fp32) takes torch's per-tensor
        # fallback, a cast to fp64 and a reduction each (~7 ms of a 1b train step on an H200; the
        # multi-tensor kernel gave the same fp64 norms there). The squares of fp32 (or bf16) values
        # are exact in fp64, so each tensor's sum of squares, and the total, do not depend on how the
        # tensor is split into shards (to fp64 rounding).
        squares: dict[bool, list[torch.Tensor]] = {True: [], False: []}  # sharded?, fp64 sums per group
        for (sharded, _, _), group in grads.items():
            norms = torch.stack(torch._foreach_norm(group, 2, dtype=torch.float64))
            squares[sharded].append((norms * norms).sum())
        device = next(iter(grads))[1] if grads else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float64, device=device)
        if self.dp.enabled or squares[True]:  # every rank joins the sum, with or without shards of its own
            sharded = torch.stack(squares[True]).sum() if squares[True] else torch.zeros((), dtype=torch.float64)
            total += self.dp.sum(sharded.to(self.dp.device), "gradient norm").to(device)
        if squares[False]:
            total += torch.stack([t.to(device) for t in squares[False]]).sum()
        if self.stage_sum is not None:
            total = self.stage_sum(total).to(device)
        return total.sqrt().float()

    # ---- update ---------------------------------------------------------------------------

    def step(self, max_grad_norm: float | None = None, skip: bool = False) -> tuple[float, bool]:
        """Clip, then update every parameter that has a gradient. Returns (grad_norm, stepped);
        a non-finite norm (or `skip`) leaves weights and state untouched and returns stepped = False."""
        return self.finish(self.launch(max_grad_norm, skip))

    def launch(self, max_grad_norm: float | None = None, skip: bool | torch.Tensor = False) -> "PendingStep":
        """`step` up to its result: the norm, the clipping and the update queued on the gradients'
        device, nothing read back (a one-process CUDA step does not wait for the backward), the
        skip decided there too (`skip`: also skip where this bool tensor is true, e.g. a non-finite
        loss). `finish` reads the result; the gradients are cleared."""
        norm = self._grad_norm()
        skipped = ~torch.isfinite(norm) | (skip.to(norm.device) if isinstance(skip, torch.Tensor) else skip)
        found_inf = skipped.float()  # the fused AdamW kernel's skip flag: 1.0 leaves everything as it is
        # clipping: every gradient times max / (norm + 1e-6) where norm > max, applied as a division
        # by its inverse (the fused kernel's grad_scale)
        inv_scale = None
        if max_grad_norm is not None:
            norm64 = norm.double()
            inv_scale = torch.where(norm64 > max_grad_norm, (norm64 + 1e-6) / max_grad_norm, 1.0).float()
        self.step_count += 1  # taken back by `finish` if the update was skipped
        live = [s for s in self.slots.values() if s.param.grad is not None]
        if self.offload:
            for s in live:  # one tensor's state on the device at a time
                self._update_offloaded(s, inv_scale, found_inf)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        else:
            for group in _groups(live):
                self._adamw(group, [s.master for s in group], [s.exp_avg for s in group],
                            [s.exp_avg_sq for s in group], inv_scale, found_inf)
        self.zero_grad()
        return PendingStep(torch.stack([norm, found_inf]))

    def finish(self, pending: "PendingStep") -> tuple[float, bool]:
        """(grad_norm, stepped) of a launched step: the host's one read of it."""
        norm, skipped = pending.result.tolist()
        if skipped:
            self.step_count -= 1
        return norm, not skipped

    @torch.no_grad()
    def _update_offloaded(self, s: _Slot, inv_scale: torch.Tensor | None, found_inf: torch.Tensor) -> None:
        dev = s.param.device
        w, m, v = (t.to(dev, non_blocking=True) for t in (s.master, s.exp_avg, s.exp_avg_sq))
        self._adamw([s], [w], [m], [v], inv_scale, found_inf)
        for src, dst in ((w, s.master), (m, s.exp_avg), (v, s.exp_avg_sq)):
            dst.copy_(src, non_blocking=True)

    @torch.no_grad()
    def _adamw(self, slots: list[_Slot], w: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor],
               inv_scale: torch.Tensor | None, found_inf: torch.Tensor) -> None:
        """The update of the module docstring for slots sharing a device and decay, with w, m, v
        their state where it is updated (on the parameters' device), in torch's fused AdamW
        kernel: one pass over w, m, v and g where the op-by-op update took ten per tensor (a 1b
        train step on an H200 went from 0.411 to 0.357 s), agreeing with it within fp32 roundings
        (tests/train/test_optimizer.py)."""
        grads = [_local(s.param.grad) for s in slots]
        if adamw_triton.runs(w[0], self.triton):
            self._adamw_triton(slots, w, grads, m, v, inv_scale, found_inf)
            return
        # the fp32 gradients the kernel reads: bf16 ones cast in one multi-tensor copy, not one cast each
        g = [t if t.dtype == torch.float32 else torch.empty_like(t, dtype=torch.float32) for t in grads]
        casts = [(dst, src) for dst, src in zip(g, grads) if dst is not src]
        if casts:
            torch._foreach_copy_([dst for dst, _ in casts], [src for _, src in casts])
        dev = w[0].device
        grad_scale = None if inv_scale is None else inv_scale.to(dev)
        if grad_scale is not None and dev.type != "cuda":  # torch's CPU kernel ignores grad_scale
            torch._foreach_div_(g, grad_scale)
            grad_scale = None
        step = torch.full((), float(self.step_count), device=dev)  # read by the kernel, not advanced
        torch._fused_adamw_(w, g, m, v, [], [step] * len(w), lr=self.lr, beta1=self.betas[0], beta2=self.betas[1],
                            weight_decay=self.weight_decay if slots[0].decay else 0.0, eps=self.eps,
                            amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=found_inf.to(dev))
        rounded = [(_local(s.param), master) for s, master in zip(slots, w) if not s.aliased]
        if rounded:
            torch._foreach_copy_([p for p, _ in rounded], [master for _, master in rounded])

    def _adamw_triton(self, slots: list[_Slot], w, grads, m, v, inv_scale, found_inf) -> None:
        """`_adamw` in adamw_triton's multi-tensor kernel: one launch per (gradient dtype, parameter
        dtype or aliased) within the group."""
        launches: dict[tuple, list[int]] = {}
        for i, (s, g) in enumerate(zip(slots, grads)):
            launches.setdefault((g.dtype, None if s.aliased else s.param.dtype), []).append(i)
        for (_, p_dtype), idx in launches.items():
            pick = lambda ts: [ts[i] for i in idx]  # noqa: E731
            adamw_triton.multi_adamw_(pick(w), pick(grads), pick(m), pick(v),
                                      None if p_dtype is None else [_local(slots[i].param) for i in idx],
                                      step=self.step_count, lr=self.lr, betas=self.betas, eps=self.eps,
                                      weight_decay=self.weight_decay if slots[0].decay else 0.0,
                                      inv_scale=inv_scale, found_inf=found_inf.to(w[0].device))

    # ---- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Moments and (non-aliased) master weights by parameter name, full tensors on the CPU.
        Sharded (FSDP) parameters: gathered from every rank (a collective: all ranks call it), and the
        fp32 master is always included, since the model's weights may be saved in bf16."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        for (name, key), t in self.state_entries():
            state.setdefault(name, {})[key] = t
        return {**self.scalars(), "state": state}

    def scalars(self) -> dict:
        """The state_dict's entries that are not tensors."""
        return {"step": self.step_count, "lr": self.lr}

    def state_entries(self) -> Iterator[tuple[tuple[str, str], torch.Tensor]]:
        """((parameter name, key), full tensor on the CPU) of state_dict's state, in its order, one at
        a time: a save streams them, so that a rank holds one gathered tensor, not its whole state."""
        for name, s in self.slots.items():
            for key, t in self._saved(s):
                yield (name, key), full_tensor(t.detach(), s.param).cpu()

    def state_specs(self) -> list[tuple[tuple[str, str], tuple[int, ...], torch.dtype]]:
        """((name, key), full shape, dtype) of each of state_entries' tensors, gathering nothing."""
        return [((name, key), tuple(s.param.shape), t.dtype) for name, s in self.slots.items()
                for key, t in self._saved(s)]

    @staticmethod
    def _saved(s: _Slot) -> list[tuple[str, torch.Tensor]]:
        """A slot's tensors a checkpoint holds: the moments, and the master where it is not the
        parameter itself (always under sharding: the weights may be saved in bf16)."""
        out = [("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq)]
        return out + [("master", s.master)] if not s.aliased or isinstance(s.param, DTensor) else out

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        missing = set(self.slots) - set(sd["state"])
        if missing:
            raise KeyError(f"optimizer state lacks {sorted(missing)[:5]} ...")
        self.step_count, self.lr = int(sd["step"]), float(sd["lr"])
        for name, s in self.slots.items():
            entry = sd["state"][name]
            s.exp_avg.copy_(local_part(entry["exp_avg"], s.param))
            s.exp_avg_sq.copy_(local_part(entry["exp_avg_sq"], s.param))
            if "master" in entry and (not s.aliased or isinstance(s.param, DTensor)):
                s.master.copy_(local_part(entry["master"], s.param))
            if not s.aliased:
                _local(s.param).copy_(s.master)
