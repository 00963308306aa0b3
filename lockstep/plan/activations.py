"""Activations one token leaves behind in one decoder layer for the backward pass.

Counted tensor by tensor, in bytes per token, bf16 (2 B) unless fp32 (4 B) is named, for
lockstep's own trainer: the eager DeepSeek-V4 of lockstep/models (deepseek_v4.py, layers/) in
bf16 with its fp32 pieces, as `Trainer` runs it without recompute. Each term names what keeps
the tensor alive (the op whose backward saved it). `split` says whether tensor parallelism with
sequence parallelism would divide the tensor across TP ranks (sequence-split streams and MoE
tokens, head-split attention tensors) or every TP rank would keep it whole (the low-rank q path,
the single K=V head, the compressors); lockstep's trainer runs TP 1, where it does not matter.

DeepSeek-V4 (H hidden, n hc_mult, h*d heads*head_dim, r q_lora_rank, g*l o_groups*o_lora_rank,
k top_k, I moe_intermediate, Is shared intermediate, E experts, S seq_len, Sk keys per query):
  per sub-block (attention, MoE), mHC (hyper_connection.py): the projection's fp32 1/rms 4 (no
      normed copy of the streams kept: Scaled/NormedProjection), bf16 streams n*H*2, coefficients
      ((2+n)*n + n + n*n)*4, the combine's block output H*2 + (n*n + n)*2, the block's RMSNorm fp32
      input and output 2*H*4
  attention (attention.py, sink_attention.py): layer input H*2, q_a RMSNorm fp32 2*r*4, q_res r*2,
      per-head q RMSNorm fp32 h*d*4 + h*4, kv RMSNorm fp32 2*d*4, then per query row (the
      queries go in blocks of B = W rows, padded to whole blocks: f = rows / S per token)
      roped q h*d*2*f, keys Sk*d*2*f/B, fp32 softmax h*(Sk+1)*4*f, bf16 probabilities h*Sk*2*f +
      argmax h*8*f; un-roped output h*d*2, o_a output g*l*2. A block's score matrix is
      materialised (not flash-style) over Sk = W + B window positions + S/m compressed entries;
      where that is more than S keys a row (S below ~2.4 W) one block of all S rows, Sk = S + S/m
  compressor (compressor.py; c = 2 overlapping C4, 1 for C128): pooled kv blocks c*d*2, fp32 and
      bf16 softmax weights c*d*(4+2), entry RMSNorm 2*d*4/m; the C4 indexer keeps nothing
  MoE (moe.py, grouped_gemm.py): shared-expert input H*2, fp32 router input + logits + scores
      H*4 + 2*E*4, routing ids/order/weights k*28, dispatched rows k*H*2, expert SwiGLU k*I*12,
      expert outputs bf16 + fp32 k*H*6, shared SwiGLU Is*12
Llama (lockstep/models/llama.py; kv KV heads, I intermediate): per sub-block RMSNorm fp32 input
  H*4 + bf16 normalised H*2 (kept by the weight) + rsqrt 4, and the block input H*2; attention in
  fp32 (`attend`): fp32 q, k, v (h + 2*kv)*d*4, the causal mask S (bool), softmax
  output and its nan_to_num h*S*4 each, output h*d*2; MLP gate, SiLU, up, product 4*I*2.
Measured against lockstep's model by tests/plan/test_plan_activations_measured.py (within 2%).
The gpu-848m config (benchmarks/grpo_step.py: 8 layers, 144-token sequences) keeps 1.971 MB per
token over its layers (that test's probe on the CPU, bf16, the GPU's Sinkhorn); these terms give
1.969 MB; x 9,216 tokens = 18.1 GB, where an H200 measured a 19.2 GB transient of the whole train
step over its set-up state (issue 18; of the other 1.1 GB the plan then had the head's 0.56 GB, counting
six fp32 logit rows a token, and not the backward's working set).

With full recomputation (TrainConfig.recompute_activations: torch.utils.checkpoint per decoder
layer, lockstep/train/recompute.py) a layer keeps only its input: n*H*2 bytes per token (the n
mHC streams), split by sequence parallelism; one layer's full set is rebuilt during backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lockstep.plan.model import ModelSpec

A, F, I64 = 2, 4, 8  # bf16, fp32 and int64 bytes


@dataclass(frozen=True)
class ActTerm:
    name: str
    bytes_per_token: float
    split: bool  # divided by TP (sequence / head parallel) or kept whole on every TP rank
    why: str = ""  # what keeps it alive


def _mhc(m: ModelSpec, tag: str) -> list[ActTerm]:
    n, H = m.hc_mult, m.hidden_size
    return [
        ActTerm(f"{tag}.hc_rsqrt_fp32", F, True, "the projection's 1/rms (no normed copy of the streams kept)"),
        ActTerm(f"{tag}.hc_streams", n * H * A, True, "bf16 streams, kept by the pre-collapse and comb^T @ X"),
        ActTerm(f"{tag}.hc_coefficients_fp32", ((2 + n) * n + n + n * n) * F, True,
                "mixes, pre, the Sinkhorn input (its fused GPU kernel keeps nothing else)"),
        ActTerm(f"{tag}.hc_combine", H * A + (n * n + n) * A, True, "block output, bf16 post and comb"),
        ActTerm(f"{tag}.norm_fp32", 2 * H * F, True, "block RMSNorm's fp32 input and normalised output"),
    ]


def attention_blocks(m: ModelSpec, ratio: int, seq_len: int) -> tuple[int, int, float]:
    """The trainer's banded attention (sink_attention.banded_sink_attention) at seq_len:
    (B query rows per block, Sk keys each block's score rows span, f query rows per token)."""
    entries = seq_len // ratio if ratio else 0
    window = m.sliding_window or seq_len  # a spec without one: every position in one block
    rows = -(-seq_len // window) * window
    # sink_attention.banded_sink_attention's rule, mirrored (the plan imports no model code); the
    # measured-activations test runs configs on both sides of it
    if rows * 2 * window >= seq_len * seq_len:  # short sequences: the dense form, one block of S
        return seq_len, seq_len + entries, 1.0
    return window, 2 * window + entries, rows / seq_len


def _v4_attention(m: ModelSpec, ratio: int, seq_len: int) -> list[ActTerm]:
    h, d, r, H = m.num_attention_heads, m.head_dim, m.q_lora_rank, m.hidden_size
    block, sk, f = attention_blocks(m, ratio, seq_len)
    out = [
        ActTerm("attn.input", H * A, True, "normed layer input, kept by every input projection"),
        ActTerm("attn.q_a_norm_fp32", 2 * r * F, False, "q_a RMSNorm's fp32 input and output"),
        ActTerm("attn.q_res", r * A, False, "q_a RMSNorm output, kept by q_b"),
        ActTerm("attn.q_norm_fp32", h * d * F + h * F, True, "per-head q RMSNorm's fp32 input, rsqrt"),
        ActTerm("attn.kv_norm_fp32", 2 * d * F, False, "kv RMSNorm's fp32 input and output"),
        ActTerm("attn.q", h * d * A * f, True, "roped q padded to whole blocks, kept by the score einsum"),
        ActTerm("attn.keys", sk * d * A * f / block, False, "each block's window + compressed keys (K = V)"),
        ActTerm("attn.softmax_fp32", h * (sk + 1) * F * f, True, "materialised scores' softmax (+ sink column)"),
        ActTerm("attn.probs", (h * sk * A + h * I64) * f, True, "bf16 probabilities for p @ V, the max's indices"),
        ActTerm("attn.unrope_out", h * d * A, True, "inverse-roped output, kept by o_a"),
        ActTerm("attn.o_a_out", m.o_groups * m.o_lora_rank * A, True, "kept by o_b"),
    ]
    if ratio:
        c = 2 if ratio == 4 else 1
        out += [ActTerm(f"compressor{ratio}.pool", c * d * (A + F + A), False,
                        "kv blocks, fp32 softmax weights and their bf16 cast, kept by the weighted sum"),
                ActTerm(f"compressor{ratio}.entry_norm_fp32", 2 * d * F / ratio, False, "entries' RMSNorm")]
    # the C4 indexer's scores only pick a top-k (integer indices, no gradient): its branch of the
    # graph is unreachable from the loss and freed once the forward leaves it
    return out


def _llama_attention(m: ModelSpec, seq_len: int) -> list[ActTerm]:
    h, kv, d = m.num_attention_heads, m.num_kv_heads, m.head_dim
    # (the fp32 cos/sin, 2*d*4, are computed once per forward and shared by every layer: left out)
    return [ActTerm("attn.qkv_fp32", (h + 2 * kv) * d * F, True, "q, k, v cast up for the fp32 attention"),
            ActTerm("attn.mask", seq_len, False, "causal mask [S, S] bool, per sequence / S"),
            ActTerm("attn.softmax_fp32", h * seq_len * F, True, "materialised scores' softmax"),
            ActTerm("attn.probs_fp32", h * seq_len * F, True, "softmax after nan_to_num, kept by p @ V"),
            ActTerm("attn.out", h * d * A, True, "kept by o_proj")]


def _llama_block(m: ModelSpec, tag: str) -> list[ActTerm]:
    H = m.hidden_size
    return [ActTerm(f"{tag}.norm", H * F + H * A + F, True, "RMSNorm's fp32 input, bf16 output (weight), rsqrt"),
            ActTerm(f"{tag}.input", H * A, True, "normalised block input, kept by the input projections")]


def _moe(m: ModelSpec) -> list[ActTerm]:
    H, k, I, E = m.hidden_size, m.num_experts_per_tok, m.moe_intermediate_size, m.n_routed_experts
    out = [
        ActTerm("moe.router_fp32", H * F + 2 * E * F, True, "fp32 router input, logits and sqrt-softplus scores"),
        ActTerm("moe.routing", k * (3 * I64 + F), True, "expert ids, dispatch order (twice), routing weights"),
        ActTerm("moe.dispatched", k * H * A, True, "rows sorted by expert, kept by fc1"),
        ActTerm("moe.expert_swiglu", k * I * A * 6, True, "fc1 out (gate, up), clamped gate, SiLU, clamped up, product"),
        ActTerm("moe.expert_out", k * H * (A + F), True, "bf16 expert outputs and the fp32 copy each weight scales"),
    ]
    if m.n_shared_experts:
        Is = m.n_shared_experts * I
        out += [ActTerm("moe.input", H * A, True, "MoE input, kept by the shared expert's gate and up"),
                ActTerm("moe.shared_swiglu", Is * A * 6, True, "gate, up, clamped gate, SiLU, clamped up, product")]
    return out


def _mlp(m: ModelSpec) -> list[ActTerm]:
    if m.is_moe:
        return _moe(m)
    return [ActTerm("mlp.swiglu", 4 * m.intermediate_size * A, True, "gate, SiLU, up, product")]


@lru_cache(maxsize=4096)
def layer_terms(m: ModelSpec, i: int, seq_len: int) -> tuple[ActTerm, ...]:
    """Every saved tensor of layer i, per token, for sequences of seq_len tokens (see the module
    docstring); cached."""
    if m.family == "deepseek_v4":
        return tuple(_mhc(m, "attn") + _v4_attention(m, m.layer_kind(i), seq_len) + _mhc(m, "mlp") + _mlp(m))
    return tuple(_llama_block(m, "attn") + _llama_attention(m, seq_len) + _llama_block(m, "mlp") + _mlp(m))


def per_token(terms, tp: int) -> float:
    """Bytes per token on one GPU: split terms / TP + whole terms."""
    return sum(t.bytes_per_token / tp if t.split else t.bytes_per_token for t in terms)


def layer_bytes_per_token(m: ModelSpec, i: int, tp: int, seq_len: int) -> float:
    """Full (no recompute) activation bytes per token of layer i on one GPU."""
    return per_token(layer_terms(m, i, seq_len), tp)


def recompute_bytes_per_token(m: ModelSpec, tp: int) -> float:
    """With full recompute a layer keeps its input only: n*H*2 / TP bytes per token."""
    return m.hc_mult * m.hidden_size * A / tp


HEAD_FP32_ROWS = 2  # fp32 [V/TP] rows per token at the head's peak: the logits and their gradient


def head_bytes_per_token(m: ModelSpec, tp: int) -> float:
    """Last stage, per token, as a GPU trainer runs the head (fp32 logits from bf16 operands:
    layers/fp32_logits.py; logprobs and entropies in one Triton kernel: logprob_entropy_triton.py).
    DeepSeek-V4: the bf16 streams n*H*2 that mHC's head collapse keeps (its fp32 mixing weights,
    a few n*4, left out), the final RMSNorm's fp32 input (the collapse's output) and output 2*H*4,
    and the bf16 rows the head GEMM keeps H*2; Llama: the final RMSNorm H*4 + H*2 and the head's
    bf16 input H*2. Then V/TP fp32 x 2: the logits the kernel keeps, and their gradient,
    which its backward writes while they are alive. Every token counts as a response row: the head
    runs on response rows only, and how many of a micro-batch's tokens are prompt the plan does not
    know (an upper bound by the prompt's share). Measured on the forward's side by
    tests/plan/test_plan_activations_measured.py. The CPU's eager path keeps more (log_softmax's
    output, the entropy's temporaries); the plan is for GPUs."""
    H = m.hidden_size
    if m.family == "deepseek_v4":
        hidden = m.hc_mult * H * A + 2 * H * F + H * A
    else:
        hidden = H * F + H * A + H * A
    return hidden + m.vocab_size / tp * F * HEAD_FP32_ROWS


def head_weight_grad_bytes(m: ModelSpec, tp: int) -> float:
    """DeepSeek-V4's head backward forms the weight's gradient as an fp32 GEMM output, then rounds
    it to the bf16 .grad: V/TP * H * (4 + 2) at once, transient (Llama's bf16 head writes its bf16
    gradient directly: counted with the gradients)."""
    return m.vocab_size / tp * m.hidden_size * (F + A) if m.family == "deepseek_v4" else 0.0


def dispatch_bytes_per_token(m: ModelSpec, tp: int) -> float:
    """MoE all-to-all send + receive buffers of the layer being run: 2 * k * H * 2 / TP
    (balanced routing; a skewed router needs more on the hot ranks)."""
    return 2 * m.num_experts_per_tok * m.hidden_size * A / tp if m.is_moe else 0.0
