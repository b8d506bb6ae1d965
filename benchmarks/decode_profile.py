"""Where a decoding step of ``generate()`` spends its time: our model on benchmarks/model.py's anchor config (822M,
bf16), static cache, greedy, as benchmarks/generate.py's ``static`` case runs it (transformers' loop over the
compiled step, one CUDA graph a step) or, with ``case=graphed``, its ``graphed`` case (blocks of 16 steps, one CUDA
graph a block).

    python benchmarks/decode_profile.py OUTDIR [case=static|graphed] [batch=1] [prompt=2048] [new_tokens=48]
    (kda_moe importable)

1. ``step``: the median interval between generated tokens (generate.py's clock), after a warm-up generate(); graphed:
   the generate()'s time less a one-token generate()'s, over its steps;
2. host split (static only): transformers' ``prepare_inputs_for_generation`` for one step, timed alone on the last
   step's arguments; the decode call (the compiled step, its CUDA-graph replay included) on that step's inputs,
   synchronised after each call and back to back (the device's time once the host keeps ahead of it); the rest of the
   step is generate()'s own loop (logits processing, the stopping check, bookkeeping);
3. kernels: a torch.profiler trace of one generate(). With CUDA graphs, the kernels of the replays: how many a step
   and their time, by name, and the device's time a step on the trace's timeline (a replay's first kernel start to
   its last kernel end, over its steps; the median replay), which is less than the kernels' summed time where
   dependent launches overlap them; without graphs every kernel of the generate(), prefill included, over its steps.

Writes OUTDIR/decode_profile.md, decode_profile.json and the trace (trace.json.gz, for chrome://tracing or Perfetto).
Without CUDA the same runs on CPU operators (no graph, no kernels: the table lists the operators' times, each nested
operator's also in its parent's), which is how the test suite checks the plumbing.
"""

import collections
import gzip
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile


def load_generate_benchmark():
    """benchmarks/generate.py, beside this file: its clock and, through it, benchmarks/model.py's models."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate.py")
    spec = importlib.util.spec_from_file_location("generate_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate_bench = load_generate_benchmark()
model_bench = generate_bench.model_bench
TOP_KERNELS = 40


def rewind(cache, tokens: int) -> None:
    """Set every layer's token count of a static cache to ``tokens``, so that repeated decode calls write inside it."""
    for layer in cache.layers:
        for name in ("cumulative_length", "tokens_seen"):
            count = getattr(layer, name, None)
            if isinstance(count, torch.Tensor):
                count.fill_(tokens)


def microseconds(fn, calls: int, synchronise_each: bool) -> float:
    """Mean microseconds of ``calls`` calls of ``fn`` after two warm-up calls."""
    for _ in range(2):
        fn()
    model_bench.sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
        if synchronise_each:
            model_bench.sync()
    model_bench.sync()
    return (time.perf_counter() - start) / calls * 1e6


def step_kernels(trace: dict, steps: int, steps_per_replay: int = 1) -> dict:
    """From a chrome trace: the kernels of the CUDA-graph replays (``steps_per_replay`` decoding steps each) when there
    are any, with the median replay's span on the timeline a step, else every GPU kernel, else the CPU operators,
    each with its count and time per step."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e["name"]]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    span = None
    if launches:
        replays = collections.defaultdict(list)
        for kernel in kernels:
            replays[kernel["args"].get("correlation")].append(kernel)
        replays = [replays[e["args"].get("correlation")] for e in launches if replays[e["args"].get("correlation")]]
        kernels, source, steps = [k for replay in replays for k in replay], "graph", len(launches) * steps_per_replay
        span = statistics.median(max(k["ts"] + k["dur"] for k in replay) - min(k["ts"] for k in replay)
                                 for replay in replays) / steps_per_replay
    elif kernels:
        source = "kernels"
    else:
        kernels = [e for e in events if e.get("cat") == "cpu_op"]
        source = "cpu_ops"
    totals, counts = collections.Counter(), collections.Counter()
    for kernel in kernels:
        totals[kernel["name"]] += kernel["dur"]
        counts[kernel["name"]] += 1
    top = [dict(name=name, us_per_step=us / steps, calls_per_step=counts[name] / steps)
           for name, us in totals.most_common(TOP_KERNELS)]
    return dict(source=source, steps=steps, per_step=len(kernels) / steps, us_per_step=sum(totals.values()) / steps,
                span_us_per_step=span, top=top)


def write_tables(res: dict, out: str) -> str:
    host, kernels = res["host_us"], res["kernels"]
    loop = "transformers' loop, a CUDA graph a step" if res["case"] == "static" else "graphed blocks"
    lines = [
        f"{res['device']}; torch {res['torch']}, transformers {res['transformers']}; {res['params'] / 1e6:.0f}M "
        f"parameters, {res['dtype']}; batch {res['batch']}, {res['prompt']}-token prompt, static cache, {loop}, "
        f"decode step compiled: {res['compiled']}.",
        "",
        "| part of a step | us |",
        "|---|---|",
        f"| the step ({'median interval between tokens' if host else 'decode time over its steps'}) | "
        f"{res['step_ms'] * 1e3:,.0f} |",
    ]
    if host:
        rest = res["step_ms"] * 1e3 - host["prepare_inputs"] - host["decode_call_synchronised"]
        lines += [
            f"| prepare_inputs_for_generation | {host['prepare_inputs']:,.0f} |",
            f"| decode call, synchronised after each | {host['decode_call_synchronised']:,.0f} |",
            f"| decode call, back to back (the device's time) | {host['decode_call_back_to_back']:,.0f} |",
            f"| the rest: generate()'s own loop | {rest:,.0f} |",
        ]
    if kernels["span_us_per_step"] is not None:
        span = kernels["span_us_per_step"]
        lines.append(f"| the device's time on the trace's timeline (median replay) | {span:,.0f} |")
    lines += [
        "",
        f"{kernels['per_step']:.0f} {'kernels' if kernels['source'] != 'cpu_ops' else 'CPU operators'} a step "
        f"({kernels['source']}), {kernels['us_per_step']:,.0f} us of their time a step, over {kernels['steps']} "
        "steps:",
        "",
        "| us a step | calls a step | name |",
        "|---|---|---|",
        *(f"| {k['us_per_step']:.1f} | {k['calls_per_step']:.2f} | `{k['name'][:100]}` |" for k in kernels["top"]),
    ]
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out, "decode_profile.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out, "decode_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    return table


def host_split(model, input_ids, options, prompt: int, new_tokens: int) -> tuple[float, dict]:
    """The static case's step (generate.py's clock, ms) and its host split (us), after a warm-up generate()."""
    import transformers

    prepare, last = model.prepare_inputs_for_generation, {}

    def prepare_and_keep(*args, **kwargs):
        last["args"], last["inputs"] = (args, kwargs), prepare(*args, **kwargs)
        return last["inputs"]

    model.prepare_inputs_for_generation = prepare_and_keep
    try:
        model.generate(input_ids, **options)  # compiles the step and tunes the kernels
        clock = generate_bench.StepClock()
        model.generate(input_ids, stopping_criteria=generate_bench.StoppingCriteriaList([clock]), **options)
    finally:
        model.prepare_inputs_for_generation = prepare
    args, kwargs = last["args"]
    inputs = last["inputs"]
    decode_call = getattr(model, "_compiled_call", None) or model.__call__
    cache = next(v for v in inputs.values() if isinstance(v, transformers.Cache))
    calls = new_tokens - 2  # within the cache's room once rewound to the prompt's end
    host = dict(prepare_inputs=microseconds(lambda: prepare(*args, **kwargs), 100, synchronise_each=True))
    for key, each in (("decode_call_synchronised", True), ("decode_call_back_to_back", False)):
        rewind(cache, prompt)
        host[key] = microseconds(lambda: decode_call(**inputs), calls - 2, synchronise_each=each)
    return clock.step_seconds() * 1e3, host


def main(out: str, case: str = "static", batch: int = 1, prompt: int = 2048, new_tokens: int = 48) -> dict:
    import transformers

    os.makedirs(out, exist_ok=True)
    dev = model_bench.dev
    config = model_bench.anchor_config()
    with tempfile.TemporaryDirectory() as folder:
        _, model = model_bench.build_models(config, folder)
    model = model.to(generate_bench.DTYPE)
    steps_per_replay = generate_bench.STEPS_PER_GRAPH[case]
    model.generation_config.decode_steps_per_graph = steps_per_replay
    input_ids = torch.randint(3, config.vocab_size, (batch, prompt), device=dev,
                              generator=torch.Generator(dev).manual_seed(0))
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                   **generate_bench.GENERATE_OPTIONS[case])
    with torch.no_grad():
        if case == "static":
            step_ms, host = host_split(model, input_ids, options, prompt, new_tokens)
        else:
            step_ms, host = generate_bench.run_case(model, case, input_ids, new_tokens)[0]["ms_per_step"], {}
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
        with profile(activities=activities) as prof:
            model.generate(input_ids, **options)
    trace_path = os.path.join(out, "trace.json")
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f, gzip.open(trace_path + ".gz", "wt") as packed:
        trace = json.load(f)
        json.dump(trace, packed)
    os.remove(trace_path)
    compiled_call = "_compiled_call" if case == "static" else "_uncaptured_compile"
    res = dict(device=torch.cuda.get_device_name() if dev == "cuda" else dev, torch=torch.__version__,
               transformers=transformers.__version__, params=sum(p.numel() for p in model.parameters()),
               dtype=str(generate_bench.DTYPE).removeprefix("torch."), case=case, batch=batch, prompt=prompt,
               compiled=getattr(model, compiled_call, None) is not None, step_ms=step_ms, host_us=host,
               kernels=step_kernels(trace, new_tokens - 1, steps_per_replay or 1))
    print(write_tables(res, out))
    return res


def parse_options(args: list[str]) -> dict:
    """``case=graphed batch=1 prompt=2048 new_tokens=48`` -> keyword arguments of ``main``."""
    options = {}
    for arg in args:
        key, _, value = arg.partition("=")
        if key == "case" and value in ("static", "graphed"):
            options[key] = value
            continue
        if key not in ("batch", "prompt", "new_tokens") or not value.isdigit():
            sys.exit(f"unknown option {arg!r}; see the usage at the top of benchmarks/decode_profile.py")
        options[key] = int(value)
    if options.get("new_tokens", 48) < 8:
        sys.exit("new_tokens must be 8 or more: the decode call is timed on the cache's room past the prompt")
    return options


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".", **parse_options(sys.argv[2:]))
