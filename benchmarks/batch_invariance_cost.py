"""What `EngineConfig.batch_invariant` costs, and whether it is needed, measured in one run.

    python benchmarks/batch_invariance_cost.py --config tiny --device cpu
    python benchmarks/batch_invariance_cost.py --config 1b --device cuda --dtype bfloat16 --batch 64

For each mode (off, on) the same greedy + seeded-sampling requests are generated once as one
batch, and request 0 is generated again alone. Printed: throughput of each mode, the ratio
on / off, and whether request 0's logprobs are bitwise identical alone and in the batch (the
property the switch guarantees; off, it holds only if the stock kernels happen to be invariant).
"""

from __future__ import annotations

import argparse
import time

import torch

from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine import Engine, GenerateRequest
from rollout_throughput import DTYPES, build_model, sync


def requests(prompts, new_tokens):
    return [GenerateRequest(p, SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_new_tokens=new_tokens,
                                              ignore_eos=True)) for i, p in enumerate(prompts)]


def measure(args, invariant: bool, prompts):
    model = build_model(args)
    cfg = EngineConfig(max_num_seqs=args.batch, max_model_len=max(map(len, prompts)) + args.new_tokens + 1,
                       max_prefill_tokens=args.prefill_chunk, dtype=args.dtype, device=args.device,
                       batch_invariant=invariant, true_on_policy=False)  # the default forward's cost
    engine = Engine(model, cfg)
    engine.generate(requests(prompts[:2], 2))  # warm-up
    sync(args.device)
    t = time.perf_counter()
    batch = engine.generate(requests(prompts, args.new_tokens))
    sync(args.device)
    seconds = time.perf_counter() - t
    alone = engine.generate(requests(prompts[:1], args.new_tokens))[0]
    same = torch.equal(alone.rollout_logprobs, batch[0].rollout_logprobs) and torch.equal(
        alone.response_ids, batch[0].response_ids)
    diff = ((alone.rollout_logprobs - batch[0].rollout_logprobs).abs().max().item()
            if alone.response_len == batch[0].response_len else float("nan"))
    return args.batch * args.new_tokens / seconds, same, diff


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=["tiny", "1b"], default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    V = build_model(args).config.vocab_size
    g = torch.Generator().manual_seed(args.seed + 1)
    lens = torch.randint(8, 65, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in lens]
    print(f"config {args.config}, batch {args.batch}, new {args.new_tokens}, device {args.device}, dtype {args.dtype}")
    res = {}
    for invariant in (False, True):
        tps, same, diff = measure(args, invariant, prompts)
        res[invariant] = tps
        print(f"batch_invariant={str(invariant):5s}: {tps:10.1f} tokens/s; request 0 alone vs in the batch: "
              f"{'bitwise identical' if same else f'differs (max |dlogprob| {diff:.2e})'}")
    print(f"throughput ratio on / off: {res[True] / res[False]:.3f}")


if __name__ == "__main__":
    main()
