"""Small models and setups whose memory terms are worked out by hand in the tests."""

import pytest

from lockstep.plan.cluster import ClusterSpec, RolloutSpec, TrainSpec
from lockstep.plan.hf_config import spec_from_config

@pytest.fixture(autouse=True)
def terminal_width(monkeypatch):
    """`lockstep plan` lays its table out for the terminal's width (COLUMNS, else the terminal, else
    100): the tests read the 100-column table whatever runs them (pytest-xdist's workers saw 80)."""
    monkeypatch.setenv("COLUMNS", "100")


TINY_V4_CONFIG = {
    "model_type": "deepseek_v4", "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 100,
    "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4, "hc_mult": 2, "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
}

TINY_LLAMA_CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 1000,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
    "tie_word_embeddings": False,
}


@pytest.fixture
def tiny_v4():
    return spec_from_config(TINY_V4_CONFIG, name="tiny-v4")


@pytest.fixture
def tiny_llama():
    return spec_from_config(TINY_LLAMA_CONFIG, name="tiny-llama")


@pytest.fixture
def small_cluster():
    """2 nodes of 4 GPUs: 1 actor node, 1 rollout node."""
    return ClusterSpec(nodes=2, gpus_per_node=4, gpu_memory_gb=1.0, actor_nodes=1, rollout_nodes=1)


@pytest.fixture
def small_train():
    """Step = 4 prompts x 2 samples x 32 tokens = 256 tokens; micro-batches of 64 tokens per GPU."""
    return TrainSpec(seq_len=32, max_tokens_per_gpu=64, rollout_batch_size=4, n_samples_per_prompt=2)


@pytest.fixture
def v4_flash_cluster():
    """GPU memory only: the offloaded optimizer needs ~2.3 TB of host memory per node, more than the
    default 2 TB (test_plan_cli.py checks that)."""
    return ClusterSpec(nodes=4, gpus_per_node=8, gpu_memory_gb=288, actor_nodes=2, rollout_nodes=2,
                       host_memory_gb=None)


def _v4_flash_train(recompute=True, offload=True):
    return TrainSpec(seq_len=4096, max_tokens_per_gpu=8192, recompute=recompute, optimizer_offload=offload,
                     decoder_last_pipeline_num_layers=10)


@pytest.fixture
def flash_train():
    """The V4-Flash setup of the issue: 4K context, 8192 tokens per GPU, last stage 10 layers."""
    return _v4_flash_train


@pytest.fixture
def rollout():
    return RolloutSpec()


@pytest.fixture
def serving_rollout():
    """Pushes in the serving format: lockstep stages a whole push on every engine GPU until the commit
    (dist/weight_push.py), and V4-Flash's bf16 push (569 GB) fits no GPU; fp8/fp4 (~150 GB) does."""
    return RolloutSpec(push_format="serving")
