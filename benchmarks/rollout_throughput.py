"""Rollout throughput: lockstep's engine vs transformers' `generate` vs the decode roofline.

    python benchmarks/rollout_throughput.py --config tiny --device cpu            # quick check
    python benchmarks/rollout_throughput.py --config 1b --device cuda --dtype bfloat16 --batch 64 --new-tokens 256
    python benchmarks/rollout_throughput.py --config 1b --device cuda --dtype bfloat16 \\
        --serving-format bf16 fp8 fp8-fp4 --packed-experts              # the formats side by side

Same DeepSeek-V4 config, same (served) weights, same prompts (random ids of --prompt-len),
greedy, every sequence generating exactly --new-tokens tokens (eos ignored), after one warm-up
generate of the same batch with 2 new tokens on each side. Printed from one run:
- lockstep: output tokens / wall time of `generate` (prefill included), and decode-only tokens/s;
- transformers: output tokens / wall time of `DeepseekV4ForCausalLM.generate` (eager attention);
- the decode roofline: per decode step the engine must at least read every weight it uses (all
  dense weights, the routed experts the batch touches: E * (1 - (1 - k/E)^B) of E per layer in
  expectation, one embedding / hash-routing row per sequence) and every sequence's cache (window
  ring + compressed entries at the mean length), at the device copy bandwidth measured here with a
  large tensor copy (bytes read + written). The weights' bytes are the engine's real storage, each
  storage once (engine.weight_bytes()): packed fp8 at 1 byte + 128x128 scales, packed fp4 experts
  at 0.5 byte + 1x32 scales, unpacked weights at their dtype's size.
The ratios are lockstep / transformers and lockstep decode / roofline.

--serving-format takes several formats: each gets its own engine, built from a fresh model of the
same --seed (the engine casts and packs its model in place) and run on the same prompts, one after
the other (the previous engine freed first, and CUDA's cached blocks released). Each format prints
its engine start, weight bytes, lockstep and roofline lines; the copy bandwidth is measured once,
transformers runs on the first format's engine only, and with bf16 among several formats the run
ends with `ratio FORMAT / bf16 tokens/s: X.XXx (decode Y.YYx)` per other format. Every run ends
with the engine memory per format: the bytes its weights (and their ratio to the same weights in
bf16) and its cache really occupy, printed per engine too (`weight bytes`, `cache bytes`).
--scheduling async sync times the decode windows chained before each read and read one by one
(EngineConfig.async_scheduling), the first the headline. --true-on-policy
runs every format a second time through the true-on-policy forward (fp8 dequantised, eager decode
graphs) and prints `ratio true-on-policy / default (FORMAT) tokens/s`. On CUDA the engine decodes
through captured CUDA graphs unless --no-cuda-graph; benchmarks/decode_step_ops.py counts the
kernels and syncs of one decode step on a CPU. Each engine's start is printed as `engine start S s
(compile cache: hit|miss|off; compiling C s (tracing T, backend B, guards G))` (engine/compile_clock.py
says what each covers); --compile-cache-dir DIR reuses compiled graphs (engine/compile_cache.py);
--compile-timers N prints after each start the N largest of torch.compile's timers over it
(`compile timers (s, largest first): ...`), to take a start's backend time apart.

`--config 1b`: 8 layers, hidden 1024, 64 routed experts top-6 (moe_intermediate 512) + 1 shared,
16 heads x head_dim 128, q_lora 512, 4 output groups of rank 256, vocab 32768: about 0.9B params,
the size of the DESIGN.md reference row (HF generate 570 tokens/s at batch 32 on one H200).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import gc
import time

import torch

from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine import Engine, GenerateRequest
from lockstep.engine.compile_clock import CompileClock
from lockstep.engine.engine import compiled_graph_count
from lockstep.engine.packed_weights import unpacked_state_dict
from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FORMATS = ["bf16", "fp8", "fp8-fp4"]


def bench_config(name: str) -> DeepseekV4Config:
    if name == "tiny":
        return tiny_config()
    if name == "1b":
        return DeepseekV4Config(
            vocab_size=32768, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=8,
            num_attention_heads=16, head_dim=128, partial_rotary_factor=0.5, q_lora_rank=512,
            n_routed_experts=64, num_experts_per_tok=6, o_groups=4, o_lora_rank=256,
            index_n_heads=16, index_head_dim=64, index_topk=128, sliding_window=128,
            layer_types=(SLIDING, SLIDING, CSA, HCA, CSA, HCA, CSA, HCA),
            compress_rates={CSA: 4, HCA: 128}, max_position_embeddings=65536,
            compress_rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                                   "beta_fast": 32, "beta_slow": 1})
    raise SystemExit(f"unknown --config {name!r}: tiny or 1b")


def build_model(args) -> DeepseekV4ForCausalLM:
    with torch.device(args.device):
        model = DeepseekV4ForCausalLM(bench_config(args.config))
    init_deepseek_v4_(model, args.seed) if args.device == "cpu" else _init_on_device(model, args.seed)
    return model.eval()


def _init_on_device(model, seed):
    # the init draws on the CPU generator; do it on a CPU copy, then move back
    model.to("cpu")
    init_deepseek_v4_(model, seed)
    model.to("cuda")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, mib: int) -> float:
    """Bytes moved (read + written) per second by a large device-to-device copy."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps, t = 0, time.perf_counter()
    while reps < 5 or time.perf_counter() - t < 0.5:
        dst.copy_(src)
        reps += 1
    sync(device)
    return 2 * src.numel() * 4 * reps / (time.perf_counter() - t)


def _storages(model):
    """Each distinct storage behind the model's parameters and buffers once -> (nbytes, every name on
    it, one tensor on it): a fused matrix and its linears' views, tied weights, counted once, as
    engine.weight_bytes() counts them (packed fp8 / fp4 as their bytes + scale tables)."""
    seen = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), (storage.nbytes(), [], t))[1].append(name)
    return seen.values()


def _is_lookup(name: str) -> bool:
    """Tables a decode step reads one row of per sequence (token embedding, hash routing)."""
    return "embed_tokens" in name or name.endswith(".tid2eid")


def weight_bytes_per_step(model, batch: int) -> float:
    """Weight bytes one decode step reads, from the storage the engine holds, not from a bf16
    assumption: an fp8 weight is 1 byte + its 128x128 scales, a packed fp4 expert 0.5 byte + its
    1x32 scales; a weight kept unpacked (bf16 format, --emulated-fp8) is its dtype's bytes."""
    c = model.config
    touched = 1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** batch
    total = 0.0
    for nbytes, names, t in _storages(model):
        if all(".experts." in n for n in names):  # routed experts: only the ones the batch touches are read
            nbytes *= touched
        elif all(_is_lookup(n) for n in names):  # a tied lm_head is read whole: not all names are lookups
            nbytes *= min(1.0, batch / t.shape[0])
        total += nbytes
    return total


def cache_bytes_per_step(c: DeepseekV4Config, batch: int, mean_len: float, itemsize: int) -> float:
    """Cache bytes one decode step reads: every sequence's window ring + compressed entries (and the
    indexer's keys on CSA layers) at the mean length, held in the engine's dtype."""
    per_seq = 0.0
    for t in c.layer_types:
        per_seq += c.sliding_window * c.head_dim * itemsize
        if t != SLIDING:
            m = c.compress_rates[t]
            per_seq += (mean_len // m) * c.head_dim * itemsize
            if t == CSA:
                per_seq += (mean_len // m) * c.index_head_dim * itemsize
    return batch * per_seq


def run_lockstep(engine: Engine, prompts, new_tokens: int, device: str, decode_steps: int | None = None,
                 scheduling: str | None = None):
    """-> (total seconds, prefill seconds, decode seconds) of one generate, stepped by hand to
    separate prefill (steps until every sequence sampled its first token) from decode.
    decode_steps, scheduling ("async" / "sync"): EngineConfig.decode_steps and async_scheduling for
    this run (None: the engine's)."""
    if decode_steps is not None:
        engine.config = dataclasses.replace(engine.config, decode_steps=decode_steps)
    if scheduling is not None:
        engine.config = dataclasses.replace(engine.config, async_scheduling=scheduling == "async")
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    states = [engine._new_state(GenerateRequest(p, sp)) for p in prompts]
    sync(device)
    t0 = time.perf_counter()
    for s in states:
        engine._add(s)
    while not all(q.num_output >= 1 or q.is_finished for s in states for q in s.sequences):
        engine.step()
    sync(device)
    t1 = time.perf_counter()
    while not all(s.done for s in states):
        engine.step()
    sync(device)
    t2 = time.perf_counter()
    return t2 - t0, t1 - t0, t2 - t1, [s.samples[0] for s in states]


def run_transformers(model, prompts, new_tokens: int, device: str):
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM as HFModel

    cfg = HFConfig(**model.config.to_hf_dict())
    cfg._attn_implementation = "eager"
    with torch.device(device):
        ref = HFModel(cfg)
    ours = unpacked_state_dict(model, model.lm_head.weight.dtype)  # packed fp8 / fp4 weights dequantised
    ref.load_state_dict(ours, strict=False)
    ref = ref.to(model.lm_head.weight.dtype).eval()
    for n, p in ref.named_parameters():  # the engine keeps these in fp32; so does HF's own loader
        if n in ours and ours[n].dtype == torch.float32:
            p.data = ours[n].clone()
    ids = torch.tensor(prompts, device=device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        ref.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up, as lockstep's
        sync(device)
        t = time.perf_counter()
        out = ref.generate(ids, **kw)
        sync(device)
    return time.perf_counter() - t, out[:, ids.shape[1]:]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compile_option(text: str) -> tuple[str, object]:
    """KEY=VALUE -> (KEY, VALUE as a Python literal, else the string)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=["tiny", "1b"], default="tiny")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--serving-format", choices=FORMATS, nargs="+", default=["bf16"],
                    help="one engine per format, one after the other, on the same weights and prompts")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--true-on-policy", action="store_true",
                    help="each format also through the true-on-policy forward (EngineConfig.true_on_policy), "
                         "with its tokens/s ratio to the default")
    ap.add_argument("--emulated-fp8", action="store_true",
                    help="fp8 linears as dequantised values (EngineConfig.packed_fp8=False), not packed")
    ap.add_argument("--packed-experts", action="store_true",
                    help="routed experts packed in the format's storage (EngineConfig.packed_experts)")
    ap.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly (EngineConfig.cuda_graph=False)")
    ap.add_argument("--decode-steps", type=int, nargs="+", default=[EngineConfig().decode_steps],
                    help="EngineConfig.decode_steps of the timed run; further values are timed too, for comparison")
    ap.add_argument("--scheduling", choices=["async", "sync"], nargs="+", default=["async"],
                    help="EngineConfig.async_scheduling of the timed run (async: the next decode window is "
                         "launched before a window is read back); a further value is timed too, for comparison")
    ap.add_argument("--eager-prefill", action="store_true", help="EngineConfig.compile_prefill=False")
    ap.add_argument("--compile-option", action="append", default=[], type=compile_option, metavar="KEY=VALUE",
                    help="an inductor setting for the engine's compiled layers (EngineConfig.compile_options), "
                         "e.g. combo_kernels=False (on by default for the decode step); repeatable")
    ap.add_argument("--compile-cache-dir", metavar="DIR",
                    help="the engine's compiled graphs, loaded before compiling and saved after a start that "
                         "compiled (EngineConfig.compile_cache_dir): another machine's start skips the compilation")
    ap.add_argument("--compile-timers", type=int, default=0, metavar="N",
                    help="after each engine start, the N largest of torch.compile's timers over it "
                         "(engine/compile_clock.CompileClock.timers)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="CUDA: then print the kernels of one more generate of the batch (kernel_profile.py)")
    ap.add_argument("--step-trace", metavar="PATH",
                    help="CUDA: write the kernels of one decode step, in launch order, with the device's idle "
                         "time before each, to PATH "
                         "(PATH.FORMAT when several engines run; PATH.FORMAT-true-on-policy for those rows)")
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="size of the bandwidth probe (default 1024 cuda, 256 cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if (args.profile or args.step_trace) and not args.device.startswith("cuda"):
        ap.error("--profile and --step-trace read CUDA kernel times: use --device cuda")
    args.serving_format = list(dict.fromkeys(args.serving_format))  # a repeated format runs once
    return args


def engine_config(args, fmt: str, true_on_policy: bool = False) -> EngineConfig:
    # the true-on-policy forward serves fp8 dequantised (its contract: EngineConfig.true_on_policy)
    return EngineConfig(max_num_seqs=args.batch, max_model_len=args.prompt_len + args.new_tokens + 1,
                        max_prefill_tokens=max(args.batch * args.prompt_len, 1), dtype=args.dtype,
                        device=args.device, serving_format=fmt, batch_invariant=args.batch_invariant,
                        true_on_policy=true_on_policy, packed_fp8=not (args.emulated_fp8 or true_on_policy),
                        packed_experts=args.packed_experts and not true_on_policy,
                        cuda_graph=not args.no_cuda_graph, compile_prefill=not args.eager_prefill,
                        compile_options=dict(args.compile_option), compile_cache_dir=args.compile_cache_dir)


def start_engine(args, fmt: str, true_on_policy: bool = False) -> tuple[Engine, tuple[int, int, int]]:
    """A fresh model per format: the engine casts and packs the model it is given in place. The
    same --seed gives every format the same weights. -> (the engine, its memory: weight bytes, the
    same weights' bf16 bytes, cache bytes)."""
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = engine_config(args, fmt, true_on_policy)
    t, clock = time.perf_counter(), CompileClock()
    engine = Engine(model, cfg)
    print(f"engine ready in {time.perf_counter() - t:.1f} s (compiling and capturing the decode graphs on CUDA)")
    status = {"nothing": "nothing to cache"}.get(engine.compile_cache.status, engine.compile_cache.status)
    phases = f"; {engine.compile_phases}" if engine.compile_phases else ""
    print(f"engine start {engine.start_seconds:.1f} s (compile cache: {status}{phases})")
    if args.compile_timers:
        timers = "; ".join(f"{name} {seconds:.1f}" for name, seconds in clock.timers(args.compile_timers))
        print(f"compile timers (s, largest first): {timers or 'nothing compiled'}")
    # packed fp8 linears as bytes + scales; the bf16 figure from the same engine (engine/packed_weights.py)
    n_bytes, n_bf16 = engine.weight_bytes(), engine.unpacked_weight_bytes()
    print(f"weight bytes {fmt} {n_bytes} ({n_bytes / n_bf16:.3f} of bf16)")
    n_cache = engine.cache.nbytes
    print(f"cache bytes {fmt} {n_cache} ({engine.cache.full_sequences} sequences of {engine.max_model_len} tokens)")
    graphs = getattr(engine.adapter, "graphs", None)
    print(f"config {args.config} ({n_params / 1e6:.1f}M params), batch {args.batch}, prompt {args.prompt_len}, "
          f"new {args.new_tokens}, device {args.device}, dtype {args.dtype}, serving {fmt}, "
          f"batch_invariant {args.batch_invariant}, true_on_policy {true_on_policy}, cuda graphs "
          + (f"on (buckets {graphs.buckets})" if graphs is not None and graphs.capture else "off")
          + (f", compile options {cfg.compile_options}" if cfg.compile_options else ""))
    return engine, (n_bytes, n_bf16, n_cache)


def time_lockstep(args, engine: Engine, prompts) -> tuple[float, float, list]:
    """Warm-up, the --decode-steps comparisons, then the headline run -> (tokens/s, decode tokens/s, samples)."""
    t, graphs_before = time.perf_counter(), compiled_graph_count()
    run_lockstep(engine, prompts, 2, args.device)  # warm-up: the timed run's prefill shapes, 2 tokens
    # the engine compiled its graphs at start: any here is a guard the start's shapes missed
    print(f"warm-up generate in {time.perf_counter() - t:.1f} s "
          f"({compiled_graph_count() - graphs_before} graphs compiled)")
    out_tokens = args.batch * args.new_tokens
    comparisons = [(steps, args.scheduling[0]) for steps in args.decode_steps[1:]]
    comparisons += [(args.decode_steps[0], scheduling) for scheduling in args.scheduling[1:]]
    for steps, scheduling in comparisons:  # the comparisons first: the headline run is the default's
        _, prefill, decode, _ = run_lockstep(engine, prompts, args.new_tokens, args.device, steps, scheduling)
        print(f"  (decode_steps {steps}, {scheduling} scheduling: {out_tokens / (prefill + decode):.1f} tokens/s, "
              f"decode {args.batch * (args.new_tokens - 1) / decode:.1f} tokens/s)")
    total, prefill, decode, samples = run_lockstep(engine, prompts, args.new_tokens, args.device,
                                                   args.decode_steps[0], args.scheduling[0])
    ls_tps = out_tokens / total
    ls_decode_tps = args.batch * (args.new_tokens - 1) / decode if decode > 0 else float("nan")
    print(f"lockstep:      {ls_tps:12.1f} tokens/s  (prefill {prefill:.3f} s, decode {ls_decode_tps:.1f} tokens/s, "
          f"decode_steps {args.decode_steps[0]}, {args.scheduling[0]} scheduling)")
    return ls_tps, ls_decode_tps, samples


def print_roofline(args, engine: Engine, bw: float, ls_decode_tps: float) -> None:
    weights = weight_bytes_per_step(engine.model, args.batch)
    cache = cache_bytes_per_step(engine.model.config, args.batch, args.prompt_len + args.new_tokens / 2,
                                 engine.dtype.itemsize)
    roof_tps = args.batch / ((weights + cache) / bw)
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write); decode step reads {(weights + cache) / 1e6:.1f} MB "
          f"(weights {weights / 1e6:.3f}, cache {cache / 1e6:.3f}) -> roofline {roof_tps:.1f} tokens/s")
    print(f"ratio lockstep decode / roofline: {ls_decode_tps / roof_tps:.3f}")


def compare_transformers(args, engine: Engine, prompts, samples, ls_tps: float) -> None:
    hf_time, hf_out = run_transformers(engine.model, prompts, args.new_tokens, args.device)
    hf_tps = args.batch * args.new_tokens / hf_time
    prefixes = sorted(common_prefix(s.response_ids.tolist(), o.tolist()) for s, o in zip(samples, hf_out.cpu()))
    agree = sum(p == args.new_tokens for p in prefixes)
    # bf16 greedy decoding of random weights: near-tied logits flip under rounding differences,
    # so completions part after a while; how long they agree is the sanity check
    print(f"transformers:  {hf_tps:12.1f} tokens/s  ({agree}/{args.batch} greedy completions identical, "
          f"median common prefix {prefixes[len(prefixes) // 2]} of {args.new_tokens} tokens)")
    print(f"ratio lockstep / transformers: {ls_tps / hf_tps:.2f}x")


def kernel_reports(args, engine: Engine, label: str, prompts, several: bool) -> None:
    if args.profile:
        from kernel_profile import profile_generate

        sp = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
        print(profile_generate(engine, [GenerateRequest(p, sp) for p in prompts]))
    if args.step_trace:
        from kernel_profile import decode_step_trace

        sp = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
        path = f"{args.step_trace}.{label}" if several else args.step_trace
        with open(path, "w") as f:
            f.write(decode_step_trace(engine, [GenerateRequest(p, sp) for p in prompts]) + "\n")


def bench_format(args, fmt: str, prompts, bw: float | None, first: bool,
                 true_on_policy: bool = False) -> tuple[float, float, float, tuple[int, int, int]]:
    """One format's engine, timed and measured -> (tokens/s, decode tokens/s, copy bandwidth, its
    memory: weight bytes, the same weights' bf16 bytes, cache bytes). The
    bandwidth is measured once, where the single-format run always measured it (after the first
    timed run); transformers runs once, on the first engine, so several formats cost no more of it."""
    engine, memory = start_engine(args, fmt, true_on_policy)
    ls_tps, ls_decode_tps, samples = time_lockstep(args, engine, prompts)
    if bw is None:
        bw = copy_bandwidth(args.device, args.copy_mib or (1024 if args.device.startswith("cuda") else 256))
    print_roofline(args, engine, bw, ls_decode_tps)
    if first and not args.skip_transformers:
        compare_transformers(args, engine, prompts, samples, ls_tps)
    label = f"{fmt}-true-on-policy" if true_on_policy else fmt
    kernel_reports(args, engine, label, prompts, several=len(args.serving_format) > 1 or args.true_on_policy)
    return ls_tps, ls_decode_tps, bw, memory


def free_device_memory(device: str) -> None:
    """The last engine's model, cache and graphs are unreferenced once bench_format returns; collect
    them (they may sit in reference cycles) and give their CUDA blocks back, so the next engine
    starts on the memory a single-format run would have."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def print_ratios(results: dict[tuple[str, bool], tuple[float, float]]) -> None:
    """Each format against bf16 (default forward), and each true-on-policy row against its format's default."""
    def ratio(a, b):
        return f"{a[0] / b[0]:.2f}x (decode {a[1] / b[1]:.2f}x)"
    for (fmt, top), figures in results.items():
        if not top and fmt != "bf16" and ("bf16", False) in results:
            print(f"ratio {fmt} / bf16 tokens/s: {ratio(figures, results[('bf16', False)])}")
        if top and (fmt, False) in results:
            print(f"ratio true-on-policy / default ({fmt}) tokens/s: {ratio(figures, results[(fmt, False)])}")


def print_memory(memory: dict[tuple[str, bool], tuple[int, int, int]]) -> None:
    """The engine's memory per format: the bytes its weights and its cache really occupy."""
    print("engine memory per format: format, weight bytes (of bf16), cache bytes, total")
    for (fmt, top), (weights, bf16, cache) in memory.items():
        label = f"{fmt} (true-on-policy)" if top else fmt
        print(f"  {label:<26} {weights:>15,} ({weights / bf16:.3f})  {cache:>15,}  {weights + cache:>15,}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed + 1)
    V = bench_config(args.config).vocab_size
    prompts = torch.randint(2, V, (args.batch, args.prompt_len), generator=g).tolist()
    results, memory, bw = {}, {}, None
    runs = [(fmt, top) for fmt in args.serving_format for top in ([False, True] if args.true_on_policy else [False])]
    for i, (fmt, top) in enumerate(runs):
        if i:
            free_device_memory(args.device)
        tps, decode_tps, bw, memory[(fmt, top)] = bench_format(args, fmt, prompts, bw, first=i == 0,
                                                               true_on_policy=top)
        results[(fmt, top)] = (tps, decode_tps)
    print_ratios(results)
    print_memory(memory)


if __name__ == "__main__":
    main()
