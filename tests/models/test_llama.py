"""Dense Llama / Qwen3: parity with transformers 5.23 on identical weights, and the incremental
(paged KV cache) path against the full-sequence forward."""

import pytest
import torch
import transformers

from lockstep.models.llama import LlamaForCausalLM, PagedKVCache, prepare_step
from lockstep.models.llama_config import LlamaConfig

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
CONFIGS = {
    "llama": LlamaConfig(**BASE),
    "llama3_rope_tied_bias": LlamaConfig(**BASE, tie_word_embeddings=True, attention_bias=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}),
    "linear_rope_mha": LlamaConfig(**{**BASE, "num_key_value_heads": 4},
                                   rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen3": LlamaConfig(model_type="qwen3", **BASE),
}


def make_pair(config: LlamaConfig, seed=0):
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    ours = LlamaForCausalLM(config).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    ours, ref = make_pair(CONFIGS[name])
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids) - ref(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff


def test_config_round_trips_through_transformers():
    for config in CONFIGS.values():
        hf = transformers.AutoConfig.for_model(**config.to_hf_dict())
        assert LlamaConfig.from_hf_dict(hf.to_dict()) == config
    legacy = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 5e5,
              "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert LlamaConfig.from_hf_dict(legacy).rope_scaling == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        LlamaConfig(**BASE, rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_left_padding_with_mask_and_positions_matches_unpadded():
    ours, _ = make_pair(CONFIGS["qwen3"])
    a, b = torch.randint(0, 97, (10,)), torch.randint(0, 97, (6,))
    ids = torch.stack([a, torch.cat([torch.zeros(4, dtype=torch.long), b])])
    mask = torch.tensor([[1] * 10, [0] * 4 + [1] * 6])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = ours(ids, attention_mask=mask, position_ids=pos)
        assert (padded[0] - ours(a[None])[0]).abs().max() <= 1e-5
        assert (padded[1, 4:] - ours(b[None])[0]).abs().max() <= 1e-5
        assert torch.isfinite(padded).all()


def run_incremental(model, seqs, chunks, block_size=4):
    """Feed sequences through forward_incremental: at each step sequence i appends chunks[step][i]
    tokens (0 = idle), all active sequences in one flattened batch. Returns per-token logits."""
    nblk = [-(-len(s) // block_size) for s in seqs]
    perm = torch.randperm(sum(nblk), generator=torch.Generator().manual_seed(0))  # scattered blocks
    tables = torch.full((len(seqs), max(nblk)), -1, dtype=torch.long)
    start = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[start:start + n]
        start += n
    cache = PagedKVCache.allocate(model.config, num_blocks=sum(nblk), block_size=block_size)
    done, out = [0] * len(seqs), [[] for _ in seqs]
    for step in chunks:
        active = [i for i, n in enumerate(step) if n]
        positions, meta = prepare_step(tables[active], [done[i] for i in active], [step[i] for i in active],
                                       block_size)
        ids = torch.cat([seqs[i][done[i]:done[i] + step[i]] for i in active])
        with torch.no_grad():
            logits = model.forward_incremental(ids, positions, cache, meta)
        for k, i in enumerate(active):
            out[i].append(logits[meta.query_start_loc[k]:meta.query_start_loc[k + 1]])
            done[i] += step[i]
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama3_rope_tied_bias"])
def test_incremental_equals_full_sequence(name):
    model, _ = make_pair(CONFIGS[name])
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in (11, 7, 9)]
    # chunked prefill of different lengths, mixed with other sequences' decode steps
    chunks = [(5, 3, 0), (1, 2, 4), (3, 1, 1), (1, 1, 1), (1, 0, 1), (0, 0, 1), (0, 0, 1)]
    got = run_incremental(model, seqs, chunks)
    for seq, logits in zip(seqs, got):
        with torch.no_grad():
            full = model(seq[None])[0]
        assert logits.shape == full.shape
        assert (logits - full).abs().max() <= 1e-5


def test_logits_indices_select_rows():
    model, _ = make_pair(CONFIGS["llama"])
    cache = PagedKVCache.allocate(model.config, num_blocks=4, block_size=4)
    tables = torch.tensor([[0, 1], [2, 3]])
    last = torch.tensor([4, 7])  # last token of each sequence in the flattened batch
    positions, meta = prepare_step(tables, [0, 0], [5, 3], 4, logits_indices=last)
    ids = torch.randint(0, 97, (8,))
    with torch.no_grad():
        logits = model.forward_incremental(ids, positions, cache, meta)
        assert logits.shape == (2, 97)
        assert (logits[0] - model(ids[None, :5])[0, -1]).abs().max() <= 1e-5
        assert (logits[1] - model(ids[None, 5:])[0, -1]).abs().max() <= 1e-5
