"""`lockstep plan`: which TP / PP / EP / CP layouts fit a model on a cluster, and why.

Example (DeepSeek-V4-Flash, 2 actor + 2 rollout nodes of 8 x 288 GB GPUs):

    lockstep plan --model deepseek-v4-flash --nodes 4 --gpus-per-node 8 --gpu-memory-gb 288 \
        --actor-nodes 2 --rollout-nodes 2 --seq-len 4096 --max-tokens-per-gpu 8192 \
        --recompute --optimizer-offload --host-memory-gb 3000 --json > plan.json
    lockstep train --layout plan.json --model DIR ...   # the best layout lockstep can run (train_flags.py)

Every flag maps to one field of ModelSpec / ClusterSpec / TrainSpec / RolloutSpec
(lockstep/plan/); the formulas are in the docstrings of lockstep/plan/{memory,rollout,comm,compute}.py.
The table fits the terminal (the seconds of each communication term need --wide or a terminal of
200 columns); below the best layout's terms, one copy of the model's weights in each rollout weight
format (bf16, fp8, native fp8-fp4) with its ratio to bf16 (`rollout_weight_formats` in --json); what
the plan assumed (uneven last pipeline stages, the host memory) is said last.
"""

from __future__ import annotations

import argparse
import shutil

DTYPES = ["fp32", "bf16", "fp16", "fp8"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lockstep.plan.cluster import HOST_MEMORY_GB, WEIGHT_FORMATS
    from lockstep.plan.model import PRESETS

    m = parser.add_argument_group("model")
    m.add_argument("--model", default="deepseek-v4-flash",
                   help=f"a preset ({', '.join(PRESETS)}) or a config.json or its directory "
                        "(default: deepseek-v4-flash)")
    c = parser.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=4, help="nodes in the cluster (default: 4)")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default: 8)")
    c.add_argument("--gpu-memory-gb", type=float, default=288.0, help="memory per GPU, GB (default: 288)")
    c.add_argument("--actor-nodes", type=int, default=None, help="default: half the nodes")
    c.add_argument("--rollout-nodes", type=int, default=None, help="default: the other nodes")
    c.add_argument("--colocate", action="store_true",
                   help="every GPU trains and serves (lockstep train's default world): a GPU holds its actor stage "
                        "and its engine; not with --actor-nodes / --rollout-nodes")
    c.add_argument("--intra-node-bandwidth-gbs", type=float, default=400.0, help="GB/s per GPU per direction")
    c.add_argument("--inter-node-bandwidth-gbs", type=float, default=50.0, help="GB/s per GPU per direction")
    c.add_argument("--host-link-bandwidth-gbs", type=float, default=50.0, help="GPU<->host GB/s (offload)")
    c.add_argument("--host-memory-gb", type=float, default=HOST_MEMORY_GB,
                   help=f"host memory per node, GB, for optimizer offload (default: {HOST_MEMORY_GB:.0f}, "
                        "the 2 TB of an 8 x H200 DGX node; 0: not checked)")
    c.add_argument("--gpu-tflops", type=float, default=400.0, help="achieved bf16 TFLOP/s per GPU")
    c.add_argument("--reserve-fraction", type=float, default=0.10,
                   help="GPU memory kept back for context, NCCL buffers, fragmentation")
    t = parser.add_argument_group("training (actor)")
    t.add_argument("--seq-len", "--context-length", dest="seq_len", type=int, default=4096,
                   help="training sequence length, prompt + response, tokens (default: 4096)")
    t.add_argument("--max-tokens-per-gpu", type=int, default=8192, help="micro-batch tokens per GPU")
    t.add_argument("--rollout-batch-size", type=int, default=32, help="prompts per step")
    t.add_argument("--n-samples-per-prompt", type=int, default=8, help="responses per prompt (default: 8)")
    t.add_argument("--param-dtype", choices=DTYPES, default="bf16", help="training weights' dtype (default: bf16)")
    t.add_argument("--grad-dtype", choices=DTYPES, default="fp32", help="gradients' dtype (default: fp32)")
    t.add_argument("--optimizer-dtype", choices=DTYPES, default="fp32", help="Adam m and v")
    t.add_argument("--recompute", action="store_true", help="full activation recomputation")
    t.add_argument("--optimizer-offload", action="store_true", help="optimizer states on the host")
    t.add_argument("--no-distributed-optimizer", action="store_true",
                   help="every data-parallel rank keeps the whole optimizer state (default: sharded)")
    t.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last pipeline stage (default: an even split where PP divides the layers, "
                        "else a lighter last stage, e.g. 11/11/11/10 for 43 layers on PP 4)")
    t.add_argument("--use-kl-loss", action="store_true",
                   help="a KL loss against a frozen reference model: one more copy of the weights per GPU")
    r = parser.add_argument_group("rollout")
    r.add_argument("--rollout-concurrency", type=int, default=256, help="sequences in flight per engine")
    r.add_argument("--rollout-gpus-per-engine", type=int, default=None, help="default: gpus per node")
    r.add_argument("--rollout-attention", choices=["dp", "tp"], default="dp",
                   help="rollout attention: data-parallel (each GPU whole sequences) or tensor-parallel (default: dp)")
    r.add_argument("--rollout-weight-format", choices=WEIGHT_FORMATS, default="native",
                   help="rollout weights as released (native: fp8 attention and shared experts, fp4 routed experts), "
                        "every fp8 / fp4 group in fp8 (128x128 block scales), or bf16 (default: native)")
    r.add_argument("--kv-cache-dtype", choices=DTYPES, default="bf16", help="rollout cache dtype (default: bf16)")
    r.add_argument("--rollout-chunk-tokens", type=int, default=8192,
                   help="chunked-prefill tokens per step, sizes the workspace (default: 8192)")
    r.add_argument("--weight-push-format", choices=["bf16", "serving"], default="bf16",
                   help="weights pushed to the rollout in bf16 or already in the serving format (default: bf16)")
    s = parser.add_argument_group("search and output")
    for dim in ("tp", "pp", "ep", "cp"):
        s.add_argument(f"--{dim}", type=int, default=None, help=f"fix {dim.upper()} instead of searching it")
    s.add_argument("--json", action="store_true", help="print a JSON list, one object per layout")
    s.add_argument("--top", type=int, default=None, help="show only the best N rows")
    s.add_argument("--feasible-only", action="store_true", help="list only the layouts that fit")
    s.add_argument("--wide", action="store_true",
                   help="the full table, with the seconds of every communication term, however wide the terminal")
    s.add_argument("--show-activations", action="store_true",
                   help="also print the saved activations per token, tensor by tensor")


def _specs(args):
    from lockstep.plan.cluster import ClusterSpec, RolloutSpec, TrainSpec
    from lockstep.plan.hf_config import load_model

    if args.colocate and (args.actor_nodes is not None or args.rollout_nodes is not None):
        raise ValueError("--colocate: every node trains and serves; drop --actor-nodes / --rollout-nodes")
    actor = args.actor_nodes if args.actor_nodes is not None else max(1, args.nodes // 2)
    rollout = args.rollout_nodes if args.rollout_nodes is not None else max(1, args.nodes - actor)
    if args.colocate:
        actor = rollout = args.nodes
    cluster = ClusterSpec(colocate=args.colocate,
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_memory_gb=args.gpu_memory_gb, actor_nodes=actor,
        rollout_nodes=rollout, intra_node_gbs=args.intra_node_bandwidth_gbs,
        inter_node_gbs=args.inter_node_bandwidth_gbs, host_link_gbs=args.host_link_bandwidth_gbs,
        host_memory_gb=args.host_memory_gb or None, gpu_tflops=args.gpu_tflops, reserve_fraction=args.reserve_fraction)
    train = TrainSpec(
        seq_len=args.seq_len, max_tokens_per_gpu=args.max_tokens_per_gpu, param_dtype=args.param_dtype,
        grad_dtype=args.grad_dtype, optimizer_dtype=args.optimizer_dtype, recompute=args.recompute,
        optimizer_offload=args.optimizer_offload, distributed_optimizer=not args.no_distributed_optimizer,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        rollout_batch_size=args.rollout_batch_size, n_samples_per_prompt=args.n_samples_per_prompt,
        use_kl_loss=args.use_kl_loss)
    roll = RolloutSpec(
        concurrency=args.rollout_concurrency, gpus_per_engine=args.rollout_gpus_per_engine or args.gpus_per_node,
        attention=args.rollout_attention, weight_format=args.rollout_weight_format,
        kv_cache_dtype=args.kv_cache_dtype, chunk_tokens=args.rollout_chunk_tokens,
        push_format=args.weight_push_format)
    return load_model(args.model), cluster, train, roll


def _console(wide: bool):
    """A console as wide as the terminal (COLUMNS when not a terminal, else 100); --wide: at least 220."""
    from rich.console import Console

    from lockstep.plan.report import WIDE_COLUMNS

    columns = shutil.get_terminal_size((100, 24)).columns
    wide = wide or columns >= WIDE_COLUMNS
    return Console(width=max(columns, 220) if wide else columns), wide


def run(args) -> int:
    from lockstep.plan.planner import plan
    from lockstep.plan.report import assumptions, render, to_json

    # errors (PlanError, bad config files) are ValueErrors: lockstep/cli.py prints them as one line, exit 2
    model, cluster, train, roll = _specs(args)
    plans = plan(model, cluster, train, roll, tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp)
    shown = [p for p in plans if p.feasible] if args.feasible_only else plans
    if args.json:
        print(to_json(shown[: args.top] if args.top else shown, cluster, train, model))
    else:
        console, wide = _console(args.wide)
        render(shown or plans, model, console, limit=args.top, activations=args.show_activations, wide=wide,
               notes=assumptions(model, cluster, train, plans), cluster=cluster, train=train)
    return 0
