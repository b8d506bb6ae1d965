"""Decoding speed on the GPU: milliseconds per decode step and decoded tokens/s of ``generate()`` (greedy) at batch 1,
8, 32 and 128 with 2K- and 32K-token prompts, for

- ``dynamic``: our KdaMoeForCausalLM with its default cache (``KdaMoeCache``);
- ``static``: ours with ``cache_implementation="static"`` through transformers' decoding loop, one step at a time
  (``decode_steps_per_graph=None``), the step compiled by transformers (``generation_config.compile_config``:
  fullgraph, CUDA graphs);
- ``graphed``: the same, decoding in blocks of ``decode_steps_per_graph = 16`` steps, each block one CUDA-graph
  replay;
- ``theirs``: transformers' KimiLinearForCausalLM with fla's kernels, on the same checkpoint;

beside the bandwidth floor: the bytes one step must read (active weights, KDA states read and written, the MLA latent
cache) over the copy bandwidth measured in the same run. Also the peak memory of each generate(), its prefill time
(to the first token) and how many of our greedy tokens equal transformers'.

``prefill`` (not run unless asked: ``cases=prefill batches=1 prompts=262144,1048576``) measures long prompts: ours
filling the dynamic cache with the prompt alone through ``prefill_in_chunks``, one run, no generation. It logs every
chunk as it ends (tokens done, seconds, peak memory so far), so a run stopped by a time limit shows how far it got,
and reports the prefill's time, tokens/s and peak memory in a table of its own.

    python benchmarks/generate.py OUTDIR [cases=dynamic,static,graphed,theirs,prefill] [batches=1,8,32,128]
                                         [prompts=2048,32768] [new_tokens=64] [prefill_chunk=N]
                                         (kda_moe importable; fla 0.6.0 for theirs)

The models are benchmarks/model.py's: its anchor config (822M parameters, 6 KDA + 2 MLA layers, 64 experts top-8,
bf16), saved by transformers and loaded by ours. A step's time is the median interval between consecutive generated
tokens (a stopping criterion that never stops reads the clock after each token, once the device is done), so the
prefill and generate()'s setup are not in it; each case runs its generate() twice and times the second, so neither
is compilation or autotuning. The graphed case has no per-token host call to read a clock in: its step is
(generate() of ``new_tokens`` tokens - generate() of one) / (``new_tokens`` - 1), each timed the same way. Prompts
longer than ``PREFILL_TOKENS`` tokens over the batch are prefilled in chunks
(generate()'s ``prefill_chunk_size``, see ``prefill_chunk_size``; ``prefill_chunk=N`` prefills every row in chunks of
N tokens) on every side: unchunked they would not fit at batch 128 x 32K. The static cases and transformers' take
shorter chunks, as their MLA layers attend a chunk through a dense mask over the cache. Writes OUTDIR/generate.md and
OUTDIR/generate.json after every case of every row (a run cut short keeps what it measured; a case that fails
records its error), and prints the tables last.
"""

import importlib.metadata
import importlib.util
import itertools
import json
import os
import sys
import tempfile
import time
import traceback

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from kda_moe import prefill_in_chunks
from kda_moe.compat import output_cache
from kda_moe.modeling.modeling_kda_moe import KdaMoeExperts


def load_model_benchmark():
    """benchmarks/model.py, beside this file: the anchor config, both models on one checkpoint, the timers."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.py")
    spec = importlib.util.spec_from_file_location("model_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


model_bench = load_model_benchmark()

GENERATE_CASES = ("dynamic", "static", "graphed", "theirs")  # the generate() cases, run by default
CASES = (*GENERATE_CASES, "prefill")
BATCHES = (1, 8, 32, 128)
PROMPTS = (2048, 32768)
NEW_TOKENS = 64
DTYPE = torch.bfloat16
PREFILL_TOKENS = 262144  # most prompt tokens (over the batch) in one prefill forward; longer prompts go in chunks
MASK_ENTRIES = 2**32  # most entries of a chunk's dense MLA mask [batch, chunk, prompt] (bool, then bf16 in SDPA)
# The cases whose MLA layers attend a prefill chunk through a dense mask over the cache: the static cache's, and
# transformers' Kimi Linear. Ours on the dynamic cache attend an unpadded chunk (these random prompts hold no pad
# token) through a lower-right causal bias, which SDPA takes without a mask tensor.
DENSE_MASK_CASES = ("static", "graphed", "theirs")
GENERATE_OPTIONS = {
    "dynamic": {},
    "static": {"cache_implementation": "static"},
    "graphed": {"cache_implementation": "static"},
    "theirs": {},
}
STEPS_PER_GRAPH = {"static": None, "graphed": 16}  # generation_config.decode_steps_per_graph of our static cases


class StepClock(StoppingCriteria):
    """Reads the clock after each generated token, once the device has finished it; never stops generation."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        model_bench.sync()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def step_seconds(self):
        """Median seconds between consecutive tokens: one decode step."""
        steps = sorted(b - a for a, b in zip(self.times, self.times[1:]))
        return steps[len(steps) // 2]


def dependent_launch_on(dev: str) -> bool:
    """Whether the graphed case's kernels launch as programmatically dependent in this run
    (kernels/dependent_launch.py: on a Hopper GPU unless KDA_MOE_DEPENDENT_LAUNCH=0)."""
    from kda_moe.kernels.dependent_launch import dependent_launch_supported

    return dependent_launch_supported(torch.device(dev))


def fla_version():
    """The version of fla, whose kernels transformers' Kimi Linear runs on CUDA tensors (read without importing it)."""
    if importlib.util.find_spec("fla") is None:
        return "not installed"
    for distribution in ("fla-core", "flash-linear-attention"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "unknown version"


def copy_bandwidth():
    """Device copy bandwidth in GB/s: bytes read plus bytes written by a 1 GiB copy (16 MiB off the GPU)."""
    size = 2**30 if model_bench.dev == "cuda" else 2**24
    source = torch.empty(size, dtype=torch.uint8, device=model_bench.dev)
    target = torch.empty_like(source)
    return 2 * size / model_bench.timed(lambda: target.copy_(source), n=20, warm=3) / 1e9


def step_bytes(model, batch, context):
    """The bytes one decode step of ``batch`` sequences must move with ``context`` tokens cached, by kind.

    - weights: every parameter but the embedding table (of which a step reads only ``batch`` rows, left out) and the
      routed experts, plus, per MoE layer, the experts that ``batch`` tokens select: E * (1 - (1 - k/E)^batch) of
      them under uniform routing;
    - kda_state: per KDA layer the fp32 recurrent state and the conv state, each read and written;
    - mla_cache: per MLA layer the latent cache (``kv_lora_rank + qk_rope_head_dim`` values per token), read.
    """
    config = model.config
    experts = [module for module in model.modules() if isinstance(module, KdaMoeExperts)]
    expert_params = {id(p) for module in experts for p in module.parameters()}
    embedding = model.get_input_embeddings().weight
    weights = sum(p.nbytes for p in model.parameters() if id(p) not in expert_params and p is not embedding)
    if model.get_output_embeddings().weight is embedding:  # tied: the head still reads the whole table
        weights += embedding.nbytes
    top_k, num_experts = config.num_experts_per_tok, config.num_experts
    selected = num_experts * (1 - (1 - top_k / num_experts) ** batch)
    weights += sum(selected * sum(p.nbytes for p in module.parameters()) / num_experts for module in experts)

    element = torch.finfo(DTYPE).bits // 8
    kda_layers = config.layer_types.count("linear_attention")
    heads, head_dim = config.linear_num_heads, config.linear_head_dim
    recurrent = heads * head_dim * head_dim * 4
    conv = 3 * heads * head_dim * (config.linear_conv_kernel_dim - 1) * element
    kda_state = kda_layers * batch * 2 * (recurrent + conv)
    mla_layers = config.layer_types.count("full_attention")
    mla_cache = mla_layers * batch * context * (config.kv_lora_rank + config.qk_rope_head_dim) * element
    return dict(weights=weights, kda_state=kda_state, mla_cache=mla_cache)


def bandwidth_floor(model, batch, prompt, new_tokens, copy_gbps):
    """The floor row: bytes per step (at the mean context of the decode) and the step time and tokens/s that moving
    them at the measured copy bandwidth allows."""
    moved = step_bytes(model, batch, prompt + new_tokens // 2)
    seconds = sum(moved.values()) / (copy_gbps * 1e9)
    return dict(bytes=moved, ms_per_step=seconds * 1e3, tok_s=batch / seconds)


def agreement(tokens, reference):
    """How far two greedy generations [B, N] agree: equal positions, of how many, and the shortest common prefix."""
    same = tokens == reference
    return dict(positions=int(same.sum()), of=same.numel(), shortest_prefix=int(same.int().cumprod(1).sum(1).min()))


def prefill_chunk_size(batch, prompt, case):
    """generate()'s `prefill_chunk_size` for a prompt [batch, prompt] in `case`: None (one forward) up to
    `PREFILL_TOKENS` tokens, else the longest chunk whose tokens stay in that budget, and for `DENSE_MASK_CASES` whose
    MLA mask (it attends to up to `prompt` positions) stays under `MASK_ENTRIES`."""
    if batch * prompt <= PREFILL_TOKENS:
        return None
    chunk = PREFILL_TOKENS // batch
    if case in DENSE_MASK_CASES:
        chunk = min(chunk, MASK_ENTRIES // (batch * prompt))
    return max(chunk, 1)


def timed_generate(model, case, input_ids, new_tokens, chunk, clock: StepClock | None = None):
    """Two identical generate() calls of ``new_tokens`` greedy tokens, the second timed (so that neither side's
    one-time kernel compilation and autotuning for the row's shapes lands in the figures): (its start and end on
    `time.perf_counter`'s clock, peak GB, the output). A `clock` reads the time after every token of the timed
    call."""
    if case in STEPS_PER_GRAPH:
        model.generation_config.decode_steps_per_graph = STEPS_PER_GRAPH[case]
    # without a clock, nothing may stop early: no end-of-sequence token; with it, min_new_tokens does that
    length = dict(eos_token_id=None) if clock is None else dict(min_new_tokens=new_tokens)
    for _ in range(2):
        if clock is not None:
            clock.times.clear()
        if model_bench.dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model_bench.sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk,
                stopping_criteria=StoppingCriteriaList([clock] if clock else []), **length, **GENERATE_OPTIONS[case],
            )
        model_bench.sync()
    return start, time.perf_counter(), model_bench.peak_gb(), out


def run_case(model, case, input_ids, new_tokens, prefill_chunk=None):
    """One generate() case on a prompt prefilled in chunks of ``prefill_chunk`` tokens (default:
    ``prefill_chunk_size``): (timings and peak memory, the generated tokens [B, new_tokens])."""
    batch, prompt = input_ids.shape
    chunk = prefill_chunk or prefill_chunk_size(batch, prompt, case)
    # `compiled` below tells whether generate() compiled (transformers keeps its call, the graphed loop its own)
    compiled_call = {"static": "_compiled_call", "graphed": "_uncaptured_compile"}.get(case)
    if compiled_call:
        model.__dict__.pop(compiled_call, None)
    if case == "graphed":
        start, end, _, _ = timed_generate(model, case, input_ids, 1, chunk)
        prefill_s = end - start
        start, end, peak, out = timed_generate(model, case, input_ids, new_tokens, chunk)
        step = (end - start - prefill_s) / (new_tokens - 1)
    else:
        clock = StepClock()
        start, end, peak, out = timed_generate(model, case, input_ids, new_tokens, chunk, clock)
        step, prefill_s = clock.step_seconds(), clock.times[0] - start
    result = dict(ms_per_step=step * 1e3, tok_s=batch / step, prefill_s=prefill_s, generate_s=end - start,
                  peak_GB=peak, prefill_chunk_size=chunk)
    if compiled_call:
        result["compiled"] = getattr(model, compiled_call, None) is not None
    return result, out[:, prompt:]


def gigabytes(value):
    return "-" if value is None else f"{value:.1f}"


def run_prefill(model, input_ids, prefill_chunk=None):
    """The ``prefill`` case: ours filling a dynamic cache with the prompt, one ``prefill_in_chunks`` call of
    ``prefill_chunk`` tokens (default: ``prefill_chunk_size``) at a time, each continuing the cache of the ones before,
    timed once (the first chunk's time includes the kernels' compilation and autotuning for its shapes). Logs each
    chunk as it ends: the tokens done, the seconds since the start, the peak memory so far."""
    batch, prompt = input_ids.shape
    chunk = prefill_chunk or prefill_chunk_size(batch, prompt, "prefill") or prompt
    if model_bench.dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cache, chunks, start = None, [], time.perf_counter()
    for begin in range(0, prompt, chunk):
        end = min(begin + chunk, prompt)
        cache = output_cache(prefill_in_chunks(model, input_ids[:, begin:end], cache=cache, chunk_size=chunk))
        model_bench.sync()
        chunks.append(dict(tokens=end, seconds=time.perf_counter() - start, peak_GB=model_bench.peak_gb()))
        model_bench.log(f"prefill {batch} x {prompt}: {end} tokens in {chunks[-1]['seconds']:.1f} s, peak "
                        f"{gigabytes(chunks[-1]['peak_GB'])} GB")
    seconds = chunks[-1]["seconds"]
    return dict(prefill_s=seconds, tok_s=batch * prompt / seconds, peak_GB=model_bench.peak_gb(),
                prefill_chunk_size=chunk, chunks=chunks)


def cell(entry):
    if entry is None:
        return "-"
    if "error" in entry:
        return "error: " + entry["error"].strip().splitlines()[-1][:70]
    return f"{entry['ms_per_step']:.2f} ms, {entry['tok_s']:,.0f} tok/s"


def ratio(row, ours, theirs="theirs"):
    a, b = row.get(ours, {}), row.get(theirs, {})
    return f"{a['tok_s'] / b['tok_s']:.2f}x" if "tok_s" in a and "tok_s" in b else "-"


def matches(entry):
    if entry is None or "same_as_theirs" not in entry:
        return "-"
    same = entry["same_as_theirs"]
    return f"{same['positions']}/{same['of']} (prefix {same['shortest_prefix']})"


def write_tables(res, out):
    """OUTDIR/generate.md and generate.json from what ``res`` holds so far; returns the markdown."""
    md = [f"GPU: {res['gpu']}; torch {res['torch']}, transformers {res['transformers']}, fla {res['fla']}; "
          f"{res['params'] / 1e6:.0f}M parameters, {res['dtype']}; {res['new_tokens']} greedy tokens per generate(); "
          f"copy bandwidth {res['copy_GBps']:.0f} GB/s; graphed blocks' kernels launched dependent: "
          f"{res.get('dependent_launch', False)}. A step: the median interval between generated tokens (graphed: the "
          "decode's time over its steps)."]
    generated = [row for row in res["rows"] if row.keys() & set(GENERATE_CASES)]
    if generated:
        md += ["", "| batch x prompt | ours (dynamic cache) | ours (static, compiled, step by step) | ours (static, "
               "graphed blocks) | transformers + fla | bandwidth floor | graphed / theirs | static / theirs | dynamic "
               "/ theirs | graphed / floor | peak GB: dynamic / static / graphed / theirs | greedy tokens = theirs: "
               "dynamic; static; graphed |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in generated:
        peaks = " / ".join(gigabytes(row.get(c, {}).get("peak_GB")) for c in GENERATE_CASES)
        same = "; ".join(matches(row.get(c)) for c in ("dynamic", "static", "graphed"))
        md.append(f"| {row['batch']} x {row['prompt']} | {cell(row.get('dynamic'))} | {cell(row.get('static'))} | "
                  f"{cell(row.get('graphed'))} | {cell(row.get('theirs'))} | {cell(row['floor'])} | "
                  f"{ratio(row, 'graphed')} | {ratio(row, 'static')} | {ratio(row, 'dynamic')} | "
                  f"{ratio(row, 'graphed', 'floor')} | {peaks} | {same} |")
    prefills = [(row, row["prefill"]) for row in res["rows"] if "prefill" in row]
    if prefills:
        md += ["", "Prefill alone (ours, dynamic cache, `prefill_in_chunks`, timed once):", "",
               "| batch x prompt | chunk | seconds | prompt tokens/s | peak GB |", "|---|---|---|---|---|"]
    for row, entry in prefills:
        shape = f"{row['batch']} x {row['prompt']}"
        md.append(f"| {shape} | {cell(entry)} | | | |" if "error" in entry else
                  f"| {shape} | {entry['prefill_chunk_size']} | {entry['prefill_s']:.1f} | {entry['tok_s']:,.0f} | "
                  f"{gigabytes(entry['peak_GB'])} |")
    text = "\n".join(md)
    with open(os.path.join(out, "generate.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "generate.json"), "w") as f:
        json.dump(res, f, indent=1)
    return text


def main(out, cases=GENERATE_CASES, batches=BATCHES, prompts=PROMPTS, new_tokens=NEW_TOKENS, prefill_chunk=None):
    import transformers

    os.makedirs(out, exist_ok=True)
    dev = model_bench.dev
    config = model_bench.anchor_config()
    with tempfile.TemporaryDirectory() as folder:
        theirs, ours = model_bench.build_models(config, folder)
    ours, theirs = ours.to(DTYPE), theirs.to(DTYPE)
    models = {"dynamic": ours, "static": ours, "graphed": ours, "theirs": theirs, "prefill": ours}
    res = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else dev, torch=torch.__version__,
               transformers=transformers.__version__, fla=fla_version(),
               params=sum(p.numel() for p in ours.parameters()), dtype=str(DTYPE).removeprefix("torch."),
               new_tokens=new_tokens, copy_GBps=copy_bandwidth(), dependent_launch=dependent_launch_on(dev),
               rows=[])
    model_bench.log(f"copy bandwidth {res['copy_GBps']:.0f} GB/s")
    # theirs first: ours compare to it
    order = [case for case in ("theirs", "dynamic", "static", "graphed", "prefill") if case in cases]
    # Every row is a new shape (batch, cache length) for the compiled decode step of the static case: allow more
    # recompilations than torch's default 8, after which it would run eagerly.
    with torch._dynamo.config.patch(recompile_limit=64):
        for prompt, batch in itertools.product(prompts, batches):
            input_ids = torch.randint(3, config.vocab_size, (batch, prompt), device=dev,
                                      generator=torch.Generator(dev).manual_seed(batch * prompt))
            row = dict(batch=batch, prompt=prompt, floor=bandwidth_floor(ours, batch, prompt, new_tokens,
                                                                         res["copy_GBps"]))
            res["rows"].append(row)
            tokens = {}
            for case in order:
                model_bench.log(f"{case} {batch} x {prompt}: start")
                try:
                    if case == "prefill":
                        row[case] = run_prefill(models[case], input_ids, prefill_chunk)
                    else:
                        row[case], tokens[case] = run_case(models[case], case, input_ids, new_tokens, prefill_chunk)
                    if case in ("dynamic", "static", "graphed") and "theirs" in tokens:
                        row[case]["same_as_theirs"] = agreement(tokens[case], tokens["theirs"])
                    if case in ("static", "graphed") and "dynamic" in tokens:
                        row[case]["same_as_dynamic"] = agreement(tokens[case], tokens["dynamic"])
                except Exception:  # noqa: BLE001
                    row[case] = dict(error=traceback.format_exc(limit=3)[-600:])
                model_bench.log(f"{case} {batch} x {prompt}: {row[case]}")
                write_tables(res, out)  # after every case: a call cut short still leaves its table
    print(write_tables(res, out))
    return res


def parse_options(args):
    """``cases=a,b batches=1,8 prompts=2048 new_tokens=64 prefill_chunk=4096`` -> keyword arguments of ``main``."""
    options = {}
    for arg in args:
        key, _, value = arg.partition("=")
        if key == "cases":
            unknown = set(value.split(",")) - set(CASES)
            if unknown:
                sys.exit(f"unknown case(s) {sorted(unknown)}; the cases are {', '.join(CASES)}")
            options["cases"] = value.split(",")
        elif key in ("batches", "prompts"):
            options[key] = [int(v) for v in value.split(",")]
        elif key == "new_tokens":
            options[key] = int(value)
            if options[key] < 2:
                sys.exit("new_tokens must be 2 or more: a step is the interval between two generated tokens")
        elif key == "prefill_chunk":
            options[key] = int(value)
            if options[key] < 1:
                sys.exit("prefill_chunk must be a positive number of tokens")
        else:
            sys.exit(f"unknown option {arg!r}; see the usage at the top of benchmarks/generate.py")
    return options


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".", **parse_options(sys.argv[2:]))
