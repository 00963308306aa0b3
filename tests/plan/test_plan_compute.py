"""Training FLOPs per token (the MFU numerator of benchmarks/train_throughput.py) by hand."""

from lockstep.plan.compute import train_flops_per_token


def test_llama_train_flops_by_hand(tiny_llama):
    # H 64, 4 heads x 16, 2 KV heads, MLP 128, vocab 1000, 4 layers, S = 32
    matmul = 64 * 64 + 2 * 64 * 2 * 16 + 64 * 64 + 3 * 64 * 128  # q, k + v, o, gate/up/down
    attention = 4 * 4 * 16 * (32 + 1) / 2  # QK^T + PV over the mean causal length
    forward = 4 * (2 * matmul + attention) + 2 * 1000 * 64  # + LM head
    assert train_flops_per_token(tiny_llama, 32) == 3 * forward == 1_319_424
    assert train_flops_per_token(tiny_llama, 32, recompute=True) == 4 * forward
