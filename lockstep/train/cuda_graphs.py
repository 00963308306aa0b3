"""The trainer's forward and backward as CUDA graphs (TrainConfig.train_cuda_graphs).

Why: on one H200 the eager 1b train step (8 x 2048 tokens) spends ~95 ms of host time launching
its forward and 60-90 ms its backward (~4,400 kernels), the GPU waiting on the host: the step is
bound by the host. A CUDA graph replays the recorded kernels with one launch (measured there: the
step went from 196 to 150 ms, now bound by its ~114 ms of kernels; docs/speed.md).

What is recorded: the model's padded forward (DeepseekV4ForCausalLM.padded_logits, which reads no
host value) and the token logprobs and entropies of the response positions (the [T_r, V] fp32
logits stay inside the graph), and the backward of both, through torch.cuda.make_graphed_callables
(its warm-up runs on a side stream, its autograd.Function replays the backward graph). The loss,
its statistics and the optimiser stay eager: a few dozen launches, and the host reads some of
their values.

A graph holds the shapes it was recorded with. So that batches of other lengths replay one, the
padded batch [b, S] and the response tokens T_r are rounded up to shape buckets (`bucket`: four
per octave, at most 25% over; the extra rows are padding, the extra response rows are sliced
away), and the graphs of the last `keep` buckets are kept (TrainConfig.train_cuda_graph_shapes; each
holds its activations' memory). A new bucket records anew: a warm-up forward and backward plus the
capture, ~3 eager steps' worth. Bucket padding changes the GEMMs' shapes, so a graphed step
equals the eager one to rounding, not bit for bit (it does where no padding is added).

Parameters: a graph reads them where they were when it was recorded. The optimiser and
Trainer.load write them in place; anything that gives a parameter new storage afterwards
(load_state_dict(assign=True), .to()) would leave the graphs reading the old tensors.

Gradients: make_graphed_callables hands the backward graph's static gradient buffers to autograd,
which takes a first gradient without a copy, so a parameter's .grad aliases the graph's buffer until
the next replay overwrites it. The trainer's optimiser consumes them before that in a step of one
micro-batch; with more, `detach_grads` copies them out before the next micro-batch.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict

import torch
from torch import nn

from lockstep.models.deepseek_v4 import padded_inputs
from lockstep.train.logprobs import MicroBatch, token_logprobs_and_entropy
from lockstep.transfer import to_device


def bucket(n: int) -> int:
    """n rounded up to a multiple of 2^(bits(n) - 3): four buckets per octave (n <= 8 stays n)."""
    step = 1 << max(n.bit_length() - 3, 0)
    return -(-n // step) * step


def bucketed_inputs(mb: MicroBatch, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(padded ids [b', S'], rows [T_r'], targets [T_r']) of a micro-batch on `device`, each size
    rounded up to its bucket: rows and targets past T_r are row 0 and target 0 (outputs to slice away)."""
    lens = mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]
    shape = (bucket(lens.numel()), bucket(int(lens.max())))
    padded, rows = padded_inputs(to_device(mb.input_ids, device), mb.cu_seqlens, mb.logit_index, shape)
    extra = bucket(rows.numel()) - rows.numel()
    return padded, nn.functional.pad(rows, (0, extra)), nn.functional.pad(to_device(mb.targets, device), (0, extra))


class PaddedLogprobs(nn.Module):
    """(padded ids [b, S], rows [T_r], targets [T_r]) -> (logprobs [T_r], entropies [T_r]): what is
    recorded. A module holding the model, so that make_graphed_callables differentiates its parameters."""

    def __init__(self, model: nn.Module, temperature: float, with_entropy_grad: bool, fused: bool | None):
        super().__init__()
        self.model = model
        self.temperature, self.with_entropy_grad, self.fused = temperature, with_entropy_grad, fused

    def forward(self, padded: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor):
        logits = self.model.padded_logits(padded, rows)
        return token_logprobs_and_entropy(logits, targets, self.temperature,
                                          with_entropy_grad=self.with_entropy_grad, fused=self.fused)


class GraphedLogprobs:
    """token_logprobs_and_entropy(model's logits of a micro-batch) with gradients, replayed from CUDA
    graphs recorded per micro-batch shape."""

    def __init__(self, model: nn.Module, temperature: float, with_entropy_grad: bool, fused: bool | None,
                 keep: int):
        if not hasattr(model, "padded_logits"):
            raise ValueError(f"TrainConfig.train_cuda_graphs: {type(model).__name__} has no padded_logits "
                             "(a forward that reads no host value; DeepSeek-V4 has)")
        self._args = (model, temperature, with_entropy_grad, fused)
        self.keep = keep
        self.graphs: OrderedDict[tuple, nn.Module] = OrderedDict()
        self.recorded = 0  # shape buckets recorded so far (a new one records anew)

    def __call__(self, mb: MicroBatch, device) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logprobs [T_r], entropies [T_r]) of the micro-batch's response tokens: views of the
        graph's buffers, which the next replay of the same bucket overwrites."""
        args = bucketed_inputs(mb, device)
        key = tuple(tuple(a.shape) for a in args)
        graphed = self.graphs.get(key)
        if graphed is None:
            graphed = self._record(key, args)
        self.graphs.move_to_end(key)
        logp, entropy = graphed(*args)
        n = mb.logit_index.numel()
        return logp[:n], entropy[:n]

    def _record(self, key: tuple, args: tuple[torch.Tensor, ...]) -> nn.Module:
        while len(self.graphs) >= self.keep:
            self.graphs.popitem(last=False)  # its pool goes with the last reference to its graphs
        module = PaddedLogprobs(*self._args)
        what = f"padded batch {list(key[0])}, {key[1][0]} response rows"
        start = time.perf_counter()
        try:  # one warm-up: the Triton kernels and cuBLAS plans of these shapes were made by it or before
            graphed = torch.cuda.make_graphed_callables(module, args, num_warmup_iters=1, allow_unused_input=True)
        except Exception as e:
            raise RuntimeError(f"TrainConfig.train_cuda_graphs: recording the forward and backward of a {what} "
                               f"failed ({type(e).__name__}: {e}); train_cuda_graphs=False runs them eagerly") from e
        self.graphs[key] = graphed
        self.recorded += 1
        # a new bucket costs ~3 eager steps: say so, as the engine does for its graphs
        print(f"lockstep trainer: CUDA graphs recorded for a {what} in {time.perf_counter() - start:.1f} s "
              f"({self.recorded} recorded, {len(self.graphs)} of {self.keep} kept)", file=sys.stderr)
        return graphed


def detach_grads(params) -> None:
    """Copy gradients out of a graph's static buffers (see the module docstring): before a further
    micro-batch of the same step replays the graph that wrote them."""
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.clone()
