"""DeepSeek-V4, written once for the trainer and the rollout engine.

    X = embed(ids) copied into hc_mult streams                         [N, S, n, H]
    per layer:  X = mHC(attn, X);  X = mHC(MoE, X)
    logits = lm_head(Norm(HyperHead(X)))

Two entry points run the same modules:
- `forward(input_ids)` — full sequences from position 0 (training; padded batches, or packed
  ones through `cu_seqlens`), differentiable;
- `forward_step(input_ids, batch, cache)` — new tokens of many sequences appended to their
  per-slot caches (rollout: chunked prefill and decode), see `StepBatch`.
Parameter names are transformers' (5.23) in-memory names, so state dicts move freely between
the two. Routed experts are returned per layer for routing replay, and can be forced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .deepseek_v4_config import DeepseekV4Config
from .deepseek_v4_rows import ExactValues, hidden_rows, layer_rows, logits_rows
from .layers.attention import DeepseekV4Attention, LayerCache
from .layers.attention_rows import FullSequences, KeySource, StepKeys
from .layers.fp32_logits import fp32_logits
from .layers.fused_linear import fuse_linears
from .layers.hyper_connection import HyperConnection, HyperHead
from .layers.moe import MoE
from .layers.norm import RMSNorm


@dataclass
class StepBatch:
    """Metadata of one incremental step: N sequences, row i has num_new[i] new tokens.

    slots [N] cache slot of each sequence; start_pos [N] position of its first new token;
    num_new [N]; positions [N, S] = start_pos + t; valid [N, S] = t < num_new (rows padded to S).
    Host ints, so that the step never reads device values (a sync that stalls the GPU's queue):
    max_new = S (None: read from num_new); max_end = max(start_pos + num_new), which bounds the
    compressed entries attended to (None: all of the cache's entries, masked by position: fixed
    shapes whatever the positions, as a captured CUDA graph needs).
    """

    slots: torch.Tensor
    start_pos: torch.Tensor
    num_new: torch.Tensor
    max_new: int | None = None
    max_end: int | None = None
    positions: torch.Tensor = field(init=False)
    valid: torch.Tensor = field(init=False)

    def __post_init__(self):
        S = self.max_new
        if S is None:
            S = int(self.num_new.max().item()) if len(self.num_new) else 0
        t = torch.arange(S, device=self.start_pos.device)
        self.positions = self.start_pos.unsqueeze(1) + t
        self.valid = t.unsqueeze(0) < self.num_new.unsqueeze(1)


@dataclass
class Routing:
    """Routed experts per MoE layer. `forced` [N, S, L, k] replays a rollout's choices;
    after a forward, `chosen` holds one [N, S, k] tensor per layer. `layer_forced` [N, S, k] is
    one layer's slice, for a Routing that serves a single layer (a compiled layer: slicing by
    `layer_idx` inside it would make the index a compile guard)."""

    forced: torch.Tensor | None = None
    chosen: list[torch.Tensor] = field(default_factory=list)
    layer_forced: torch.Tensor | None = None

    def forced_for(self, layer_idx: int) -> torch.Tensor | None:
        if self.layer_forced is not None:
            return self.layer_forced
        return self.forced[..., layer_idx, :] if self.forced is not None else None

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.chosen, dim=-2)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.self_attn = DeepseekV4Attention(c, layer_idx)
        self.mlp = MoE(c, layer_idx)
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        hc = (c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, streams, token_ids, routing: Routing | None, attend) -> torch.Tensor:
        """attend: the attention for these streams (forward_full, or a step's forward_step), or a key
        source (FullSequences / StepKeys): then the true-on-policy forward (deepseek_v4_rows.py)."""
        if isinstance(attend, KeySource):
            return layer_rows(self, streams, token_ids, attend, routing)
        # each block's input is the collapsed streams after its norm (the decode kernel does both)
        # (pre: the streams handed on for the combine; hyper_connection.threads_streams)
        streams, block_in, post, comb = self.attn_hc.pre(streams, self.input_layernorm)
        # the attention's combine, then the MoE's mHC pre (a decode step: the combine in its kernel)
        streams, block_in, post, comb = self.ffn_hc.after(streams, attend(block_in), post, comb,
                                                          self.post_attention_layernorm)
        forced = routing.forced_for(self.layer_idx) if routing is not None else None
        # the MoE returns the streams after the combine (its decode kernel may do that combine too)
        streams, experts = self.mlp(block_in, token_ids, forced, hc=(streams, post, comb))
        if routing is not None:
            routing.chosen.append(experts)
        return streams


class DeepseekV4Model(nn.Module):
    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, c.hc_eps, c.rms_norm_eps)
        self.hc_mult = c.hc_mult
        self.call_layer = None  # every forward's layers compiled: compiled_layers.compile_layers

    def run(self, input_ids, routing, attend_for, call_layer=None) -> torch.Tensor:
        """-> final hidden states. `call_layer(layer, streams, input_ids, routing, attend)` stands in
        for `layer(...)` where the layers run compiled (models/compiled_layers.py): passed for one
        call (the engine's decode step) or set as the `call_layer` attribute (the trainer)."""
        call_layer = call_layer or self.call_layer or _call_layer
        streams = self.embed_streams(input_ids)
        for layer in self.layers:
            streams = call_layer(layer, streams, input_ids, routing, attend_for(layer))
        final = getattr(call_layer, "final_hidden", None)  # compiled along with the layers
        return final(self, streams) if final is not None else self.final_hidden(streams)

    def embed_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [..., S] -> the first layer's mHC streams [..., S, n, H] (the embedding, copied)."""
        x = self.embed_tokens(input_ids)
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.hc_mult, x.shape[-1]).contiguous()

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """Streams [..., n, D] after the last layer -> hidden [..., D]: mHC's head, then the norm."""
        return self.norm(self.hc_head(streams))


def _call_layer(layer, *args):
    return layer(*args)


def padded_inputs(ids: torch.Tensor, cu_seqlens: torch.Tensor, logit_index: torch.Tensor | None = None,
                  shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ids [T] of sequences starting at cu_seqlens [b + 1] -> (`padded_ids`, `padded_rows` on
    ids' device): the right-padded batch and each (wanted) packed position's row of it. Rows start at
    position 0 and are causal: padding never reaches a real token. The lengths and rows are worked
    out on the host from cu_seqlens and logit_index (a caller's CPU copies: no device sync), then
    copied over once."""
    padded = padded_ids(ids, cu_seqlens, shape)
    return padded, padded_rows(cu_seqlens, padded.shape[1], logit_index).to(ids.device)


def padded_ids(ids: torch.Tensor, cu_seqlens: torch.Tensor, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """Packed ids [T] -> the right-padded batch [b, S] (with 0; S the longest sequence), or padded to
    `shape` [b', S'] instead (at least [b, S]; rows of padding only past b)."""
    cu = cu_seqlens.cpu()
    padded = nn.utils.rnn.pad_sequence(list(ids.split((cu[1:] - cu[:-1]).tolist())), batch_first=True)
    if shape is None:
        return padded
    if shape[0] < padded.shape[0] or shape[1] < padded.shape[1]:
        raise ValueError(f"padded_ids: shape {tuple(shape)} is smaller than the batch's {tuple(padded.shape)}")
    return nn.functional.pad(padded, (0, shape[1] - padded.shape[1], 0, shape[0] - padded.shape[0]))


def padded_rows(cu_seqlens: torch.Tensor, S: int, logit_index: torch.Tensor | None = None) -> torch.Tensor:
    """Each packed position's row of the padded [b * S] (or those of `logit_index`'s positions), on
    the host."""
    cu = cu_seqlens.cpu()
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])  # [T] sequence of each position
    rows = seq * S + torch.arange(int(cu[-1])) - cu[:-1][seq]
    return rows if logit_index is None else rows[logit_index.cpu()]


class DeepseekV4ForCausalLM(nn.Module):
    config_class = DeepseekV4Config
    # kept in fp32 whatever the model dtype (as DeepSeek ships them); matched as precision.py says
    _keep_in_fp32_modules_strict = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias",
                                    "e_score_correction_bias", "norm.weight", "layernorm.weight")

    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        self.config = config
        self.model = DeepseekV4Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, routing: Routing | None = None,
                cu_seqlens: torch.Tensor | None = None, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, V] (fp32). Rows start at position 0 and are causal,
        so right padding never changes the real tokens. With cu_seqlens, input_ids is a packed
        [T] (or [1, T]) of several sequences and the logits come back packed [T, V]; with
        logit_index too, only the logits of those packed positions, [len(logit_index), V]: the
        head runs on those rows alone (a trainer wants the response positions: the [T, V] fp32
        logits of a whole batch are GBs, and picking rows from them cost a copy each way)."""
        if cu_seqlens is not None:
            return self._forward_packed(input_ids.reshape(-1), cu_seqlens, routing, logit_index)
        if logit_index is not None:
            raise ValueError("logit_index indexes packed positions: it needs cu_seqlens")
        return self._logits(input_ids, routing, lambda hidden: hidden)

    def _logits(self, input_ids: torch.Tensor, routing: Routing | None, pick) -> torch.Tensor:
        """Logits of the hidden rows `pick(hidden [B, S, H])` selects."""
        if self.true_on_policy:
            return self._true_on_policy_logits(input_ids, routing, pick)
        return self._default_logits(input_ids, routing, pick)

    def _default_logits(self, input_ids: torch.Tensor, routing: Routing | None, pick) -> torch.Tensor:
        hidden = self.model.run(input_ids, routing, lambda layer: layer.self_attn.forward_full)
        return self._head(pick(hidden))

    def _true_on_policy_logits(self, input_ids: torch.Tensor, routing: Routing | None, pick) -> torch.Tensor:
        """The true-on-policy forward (deepseek_v4_rows.py). With a gradient wanted (training), its
        values carry the default forward's gradient (issue 16: "the backward may use anything"): the
        row-block forward runs without autograd, the default one, with the experts the first chose
        forced, builds the graph. Backpropagating through the row blocks cost ~2x the whole step.
        The head's rows are independent of each other, so picking rows before it keeps their bits."""
        keys = FullSequences(*input_ids.shape, input_ids.device)
        if not torch.is_grad_enabled():
            return logits_rows(self, pick(hidden_rows(self.model, input_ids, keys, routing)))
        chosen = Routing(forced=routing.forced if routing is not None else None)
        with torch.no_grad():
            exact = logits_rows(self, pick(hidden_rows(self.model, input_ids, keys, chosen)))
        fast = self._default_logits(input_ids, Routing(forced=chosen.stacked()), pick)
        if routing is not None:
            routing.chosen = chosen.chosen
        return ExactValues.apply(fast, exact)

    @property
    def true_on_policy(self) -> bool:
        """The true-on-policy forward is switched on (KernelSwitches; deepseek_v4_rows.py)."""
        # the head's switch, not a layer's: a pipeline's last stage holds the head, not layer 0
        return self.model.hc_head.kernels.on("true_on_policy")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] fp32: `_head`, in row blocks in the true-on-policy forward."""
        if self.true_on_policy:
            return logits_rows(self, hidden)
        return self._head(hidden)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head, fp32 logits whatever the model dtype (layers/fp32_logits.py says why and how)."""
        return fp32_logits(hidden, self.lm_head.weight)

    def _forward_packed(self, ids: torch.Tensor, cu_seqlens: torch.Tensor, routing, logit_index) -> torch.Tensor:
        return self.padded_logits(*padded_inputs(ids, cu_seqlens, logit_index), routing)

    def padded_logits(self, padded: torch.Tensor, rows: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        """Logits [len(rows), V] of the rows `rows` of a right-padded batch padded [b, S] (flattened
        [b * S]; `padded_inputs` builds both from packed sequences). The default forward reads no
        device value on the host here: the same shapes launch the same kernels, which is what a CUDA
        graph of the trainer's forward needs (train/cuda_graphs.py)."""
        return self._logits(padded, routing, lambda hidden: hidden.reshape(-1, hidden.shape[-1])[rows])

    @torch.no_grad()
    def forward_step(self, input_ids: torch.Tensor, batch: StepBatch, cache: "DeepseekV4Cache",
                     routing: Routing | None = None) -> torch.Tensor:
        """input_ids [N, S] (rows padded past num_new) -> logits [N, S, V] fp32; appends to cache."""
        return self.compute_logits(self.hidden_step(input_ids, batch, cache, routing))

    def hidden_step(self, input_ids: torch.Tensor, batch: StepBatch, cache: "DeepseekV4Cache",
                    routing: Routing | None = None, call_layer=None) -> torch.Tensor:
        """forward_step up to the final norm -> hidden [N, S, H] (the engine runs the LM head only
        over the rows it samples from). call_layer: compiled layers (DeepseekV4Model.run)."""
        if self.true_on_policy:
            return hidden_rows(self.model, input_ids, StepKeys(batch, cache), routing)

        def attend_for(layer):
            layer_cache = cache.layers[layer.layer_idx]  # looked up here: a compiled layer must not guard on it
            return lambda h: layer.self_attn.forward_step(h, batch, layer_cache)

        return self.model.run(input_ids, routing, attend_for, call_layer)

    def fuse_projections(self) -> None:
        """Per layer, the attention's and the MoE's input projections become one GEMM each
        (layers/fused_linear.py; the engine calls this once its weights are in place, and after
        each weight update, when it rebuilds only fused matrices whose views were replaced)."""
        for layer in self.model.layers:
            fuse_linears(layer.self_attn, layer.self_attn.input_linears())
            fuse_linears(layer.mlp, layer.mlp.input_linears())

    def new_cache(self, num_slots: int, max_len: int, dtype=None, device=None) -> "DeepseekV4Cache":
        p = self.lm_head.weight
        dtype, device = dtype or p.dtype, device or p.device
        return DeepseekV4Cache([layer.self_attn.new_cache(num_slots, max_len, dtype, device)
                                for layer in self.model.layers])


@dataclass
class DeepseekV4Cache:
    """Rollout caches of every layer, indexed by slot (one slot per running sequence). Every
    tensor has one extra scratch slot at the end (`layers[i].scratch_slot`): fixed-shape writes
    send masked-out tokens there, and padding rows of a CUDA-graph batch use it as their slot."""

    layers: list[LayerCache]

    def reset(self, slots) -> None:
        slots = torch.as_tensor(slots, device=self.layers[0].window.device)
        for layer in self.layers:
            layer.reset(slots)

    def reset_all(self) -> None:
        """Every slot (the scratch slot too) back to its initial value: the tensors cleared whole, the
        zeros in one multi-tensor call, where indexing every slot was a write per tensor (57 on an
        8-layer model) after each weight update."""
        values = [pair for layer in self.layers for pair in layer.initial_values()]
        torch._foreach_zero_([t for t, value in values if value == 0])
        for t, value in values:
            if value != 0:
                t.fill_(value)

    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for layer in self.layers for t in layer.tensors())
