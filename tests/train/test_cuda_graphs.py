"""TrainConfig.train_cuda_graphs: the forward and backward replayed from CUDA graphs (train/cuda_graphs.py)
train as the eager ones do. The graphs need a GPU (LOCKSTEP_TEST_DEVICE=cuda runs those tests there);
here on the CPU: what they build on (the padded layout that reads no device value, the same in the
eager forward) and the settings they refuse."""

from __future__ import annotations

import copy

import pytest
import torch

from devices import DEVICE
from lockstep.models.deepseek_v4 import padded_inputs
from lockstep.models.precision import cast_model
from lockstep.train.config import TrainConfig
from lockstep.train.cuda_graphs import GraphedLogprobs, PaddedLogprobs, bucket, bucketed_inputs
from lockstep.train.logprobs import microbatch_logits, pack_microbatches, token_logprobs_and_entropy
from lockstep.train.trainer import Trainer
from tests.train.trainer_fixtures import make_samples, tiny_model

on_gpu = pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs: LOCKSTEP_TEST_DEVICE=cuda runs this on a GPU")


def test_padded_inputs_put_each_packed_position_on_its_row():
    ids = torch.arange(10, 19)  # sequences of 2, 4, 3 tokens
    cu = torch.tensor([0, 2, 6, 9])
    padded, rows = padded_inputs(ids, cu)
    assert padded.tolist() == [[10, 11, 0, 0], [12, 13, 14, 15], [16, 17, 18, 0]]
    assert torch.equal(padded.flatten()[rows], ids)
    logit_index = torch.tensor([1, 3, 4, 7])
    assert torch.equal(padded_inputs(ids, cu, logit_index)[1], rows[logit_index])


@pytest.mark.parametrize("field, value", [("recompute_activations", True),
                                          ("quant_aware_forward", "fp8"), ("use_rollout_routing_replay", True),
                                          ("expert_model_parallel_size", 2), ("pipeline_model_parallel_size", 2)])
def test_settings_a_graph_cannot_record_are_refused(field, value):
    with pytest.raises(ValueError, match=f"train_cuda_graphs: not combined with {field}"):
        TrainConfig(train_cuda_graphs=True, **{field: value})


def test_true_on_policy_is_refused_and_decided_off_with_graphs():
    with pytest.raises(ValueError, match="true_on_policy"):
        TrainConfig(train_cuda_graphs=True, true_on_policy=True)
    assert TrainConfig(train_cuda_graphs=True).true_on_policy_excluded_by() == "train_cuda_graphs"


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's refusal")
def test_graphs_on_the_cpu_are_an_error_naming_the_field():
    with pytest.raises(ValueError, match="train_cuda_graphs: CUDA graphs need the model on a CUDA device"):
        Trainer(tiny_model(), TrainConfig(train_cuda_graphs=True))


def test_buckets_cover_n_by_at_most_a_quarter_in_four_steps_per_octave():
    values = [bucket(n) for n in range(1, 5000)]
    assert all(n <= b <= max(n, 1.25 * n) for n, b in zip(range(1, 5000), values))
    assert values == sorted(values) and bucket(2048) == 2048 and bucket(2049) == 2560
    assert len({bucket(n) for n in range(1025, 2049)}) == 4  # batches of other lengths share a graph


def test_padded_inputs_pad_to_a_bucket_shape():
    ids, cu = torch.arange(10, 19), torch.tensor([0, 2, 6, 9])
    padded, rows = padded_inputs(ids, cu, shape=(4, 6))
    assert padded.shape == (4, 6) and not padded[3].any() and not padded[:, 4:].any()
    assert torch.equal(padded.flatten()[rows], ids)
    with pytest.raises(ValueError, match=r"shape \(2, 6\) is smaller than the batch's \(3, 4\)"):
        padded_inputs(ids, cu, shape=(2, 6))


def test_what_a_graph_records_gives_the_eager_logprobs_on_bucket_shapes():
    """The recorded function on a micro-batch's bucketed inputs (batch rows and positions padded,
    response rows padded with row 0), sliced, against the trainer's eager forward: equal to rounding
    (a CPU GEMM's sums depend on its row count)."""
    model = tiny_model()
    mb = pack_microbatches(make_samples(6, seed=1), 4096)[0]  # [6, 11] -> [6, 12]; 31 rows -> 32
    args = bucketed_inputs(mb, "cpu")
    assert [tuple(a.shape) for a in args] == [(6, 12), (32,), (32,)]
    logp, entropy = PaddedLogprobs(model, 1.0, False, None)(*args)
    want_logp, want_entropy = token_logprobs_and_entropy(microbatch_logits(model, mb, "cpu"), mb.targets, 1.0)
    torch.testing.assert_close(logp[:31], want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[:31], want_entropy, rtol=1e-5, atol=1e-5)


@on_gpu
def test_the_recorded_function_never_syncs_with_the_host():
    """What a graph records must not read a device value on the host (a capture would fail on it):
    the padded forward and backward of a bf16 model under sync_debug_mode "error", after one warm-up
    call as make_graphed_callables makes before it records (the first call compiles the mHC
    coefficients, and inductor's compilation reads the device)."""
    model = tiny_model()
    model.to(DEVICE)
    cast_model(model, torch.bfloat16)
    mb = pack_microbatches(make_samples(6, seed=1), 4096)[0]
    args = bucketed_inputs(mb, DEVICE)
    padded = PaddedLogprobs(model, 1.0, False, None)
    padded(*args)[0].sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logp, _ = padded(*args)
        logp.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_a_failed_recording_is_an_error_naming_the_field_and_the_shape(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", refuse)
    graphs = GraphedLogprobs(tiny_model(), 1.0, False, None, keep=2)
    mb = pack_microbatches(make_samples(6, seed=1), 4096)[0]
    with pytest.raises(RuntimeError, match=r"train_cuda_graphs: recording the forward and backward of a padded "
                                           r"batch \[6, 12\], 32 response rows failed \(RuntimeError: operation "
                                           r"not permitted.*train_cuda_graphs=False runs them eagerly"):
        graphs(mb, "cpu")
    assert graphs.recorded == 0 and not graphs.graphs


def _pair(max_tokens: int, **extra):
    model = tiny_model()
    model.to(DEVICE)
    cast_model(model, torch.bfloat16)
    base = dict(dtype="bfloat16", max_tokens_per_gpu=max_tokens, true_on_policy=False, **extra)
    return Trainer(copy.deepcopy(model), TrainConfig(**base)), Trainer(model, TrainConfig(train_cuda_graphs=True, **base))


@on_gpu
@pytest.mark.parametrize("max_tokens", [4096, 16])  # one micro-batch; two (gradients accumulated)
def test_graphed_steps_on_bucket_shapes_equal_eager_steps_bit_for_bit(max_tokens):
    """Samples of 4 + 4 tokens: [4, 8] padded, 16 response rows (or [2, 8] and 8 twice) are buckets
    already, so the graphs run the eager kernels on the eager shapes."""
    eager, graphed = _pair(max_tokens)
    for step in range(3):
        samples = make_samples(4, seed=step, prompt_len=(4, 4), response_len=(4, 4))
        a, b = eager.train_step(samples), graphed.train_step(samples)
        for key in ("train/loss", "train/grad_norm", "train/entropy", "train/pg_clipfrac"):
            assert a[key] == b[key], (step, key)
    for (name, x), (_, y) in zip(eager.named_weights(), graphed.named_weights()):
        assert torch.equal(x, y), name
    assert graphed.graphs.recorded == 1  # one bucket, replayed after its first step


@on_gpu
def test_graphed_steps_on_padded_buckets_agree_with_eager_steps():
    eager, graphed = _pair(4096)
    # [6, 11] -> [6, 12] padded, 31 -> 32 response rows; [5, 11] -> [5, 12], 19 -> 20
    batches = [make_samples(6, seed=1), make_samples(5, seed=2), make_samples(6, seed=1)]
    for step, samples in enumerate(batches):  # the last one replays the first one's graphs
        a, b = eager.train_step(samples), graphed.train_step(samples)
        for key in ("train/loss", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=2e-2), (step, key)
    assert graphed.graphs.recorded == 2


@on_gpu
def test_graphs_record_compiled_layers_and_equal_their_eager_launches():
    """compile_backend with train_cuda_graphs: the warm-up call compiles the layers (forward and
    backward), the capture records inductor's kernels; on bucket shapes the replayed steps equal the
    same compiled layers launched one by one, bit for bit."""
    torch._dynamo.reset()
    eager, graphed = _pair(4096, compile_backend="inductor")
    for step in range(3):
        samples = make_samples(4, seed=step, prompt_len=(4, 4), response_len=(4, 4))
        a, b = eager.train_step(samples), graphed.train_step(samples)
        for key in ("train/loss", "train/grad_norm"):
            assert a[key] == b[key], (step, key)
    for (name, x), (_, y) in zip(eager.named_weights(), graphed.named_weights()):
        assert torch.equal(x, y), name
    assert graphed.graphs.recorded == 1 and graphed.model.model.call_layer is not None
