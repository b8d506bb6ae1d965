"""End to end on the GPU: our KdaMoeForCausalLM against transformers' KimiLinearForCausalLM with fla's kernels, both
holding the same weights and timed in one run: a training step (forward, backward, AdamW), a long prefill and batched
decoding through ``generate()``; tokens/s, peak memory and ratios. Some cases also time variants of ours in the same run
(``VARIANTS``): training with the loss computed from the [tokens, vocab] logits (``config.fused_linear_cross_entropy=
False``), as transformers computes it, and training and prefill with the routed experts through transformers'
grouped_mm instead of our grouped kernels.

    python benchmarks/model.py OUTDIR [profile] [cases=train_step,prefill,generate]
                                                     (kda_moe importable; fla 0.6.0 for transformers' kernels)

The benchmark's config (``anchor_config``: 822M parameters, 6 KDA + 2 MLA layers, NoPE MLA, 64 experts top-8 + 1
shared, bf16) is built as a random KimiLinear model and saved; ours loads that checkpoint (``modeling/conversion.py``),
so both sides hold the same weights. Before timing, the run compares fp32 logits on one 256-token prompt: ours against
transformers', and ours against our own PyTorch backend (which separates kernel precision from a difference in the
model). Each case is timed as the median of a few calls after warm-up calls. Writes OUTDIR/model_bench.md and
OUTDIR/model_bench.json after each side of every case (a run cut short keeps what it measured), prints a line with the
seconds since the start as each side of a case begins and ends, and prints the table last. ``profile`` replaces the
timed cases by a torch.profiler table of one training step at the first training shape per side (the kernels sorted by
their own time), written to OUTDIR/model_profile_{theirs,ours}.txt: where a training step's time goes. ``cases=`` keeps
only the listed kinds of case.
"""

import json
import os
import sys
import tempfile
import time
import traceback

import torch

from kda_moe import KdaMoeForCausalLM

dev = "cuda"
LAYERS = 8
# (case, shape): training steps (B, T), prefills (T,), generate (B, prompt, new tokens)
CASES = [("train_step", (4, 4096)), ("train_step", (1, 16384)), ("prefill", (16384,)), ("prefill", (65536,)),
         ("generate", (1, 2048, 128)), ("generate", (32, 2048, 128))]


def anchor_config():
    """The KimiLinear config both models are timed on: Kimi Linear's layout at 822M parameters."""
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=256, q_lora_rank=None,
        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, num_local_experts=64, num_experts_per_tok=8,
        n_shared_experts=1, routed_scaling_factor=1.0, linear_head_dim=128, linear_num_heads=8,
        linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)],
        mlp_layer_types=["dense"] + ["sparse"] * (LAYERS - 1), pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def kimi_linear_class():
    from transformers import KimiLinearForCausalLM

    return KimiLinearForCausalLM


START = time.perf_counter()


def log(message):
    print(f"[{time.perf_counter() - START:6.0f} s] {message}", flush=True)


def build_models(config, folder):
    """(transformers' model, ours) with the same random weights, fp32 on ``dev``: transformers' model is saved to
    ``folder`` and ours loads that checkpoint."""
    torch.manual_seed(0)
    theirs = kimi_linear_class()(config)
    theirs.generation_config.eos_token_id = None  # random weights: every generation runs its full length
    theirs.save_pretrained(folder)
    ours = KdaMoeForCausalLM.from_pretrained(folder)
    ours.generation_config.eos_token_id = None
    return theirs.to(dev), ours.to(dev)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def timed(fn, n, warm):
    """Median seconds of n calls after warm calls."""
    for _ in range(warm):
        fn()
    sync()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def peak_gb():
    return torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None


def train_step(model, shape, vocab):
    """A closure running one training step (forward, backward, AdamW) on random tokens of ``shape`` = (B, T); it
    leaves ``model`` in training mode."""
    ids = torch.randint(3, vocab, shape, device=dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def profile_train_step(model, shape, vocab):
    """torch.profiler's table of one training step after two warm-up steps, the 30 costliest kernels (on CPU: ops)
    by their own time."""
    step = train_step(model, shape, vocab)
    for _ in range(2):
        step()
    sync()
    on_gpu = dev == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if on_gpu else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        step()
        sync()
    model.eval()
    return prof.key_averages().table(sort_by="self_device_time_total" if on_gpu else "self_cpu_time_total",
                                     row_limit=30)


def run_case(model, case, shape, vocab):
    """One case on one model: a dict of seconds, throughput and peak memory."""
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if case == "train_step":
        s = timed(train_step(model, shape, vocab), n=5, warm=2)
        model.eval()
        return dict(s=s, tok_s=shape[0] * shape[1] / s, peak_GB=peak_gb())
    with torch.no_grad():
        if case == "prefill":
            (T,) = shape
            ids = torch.randint(3, vocab, (1, T), device=dev)
            s = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), n=3, warm=1)
            return dict(s=s, tok_s=T / s, peak_GB=peak_gb())
        B, P, N = shape
        ids = torch.randint(3, vocab, (B, P), device=dev)
        s = timed(lambda: model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False), n=2, warm=1)
        s_prompt = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), n=2, warm=1)
        decode = max(s - s_prompt, 1e-9)
        return dict(s=s, decode_tok_s=B * N / decode, ms_per_step=decode / N * 1e3, peak_GB=peak_gb())


def logits_errors(ours, references, vocab):
    """Relative errors of our fp32 logits against each reference model's on one 256-token prompt (same weights)."""
    ids = torch.randint(3, vocab, (1, 256), device=dev)
    with torch.no_grad():
        a = ours.eval()(input_ids=ids).logits.double()
        bs = [model.eval()(input_ids=ids).logits.double() for model in references]
    return [((a - b).norm() / b.norm()).item() for b in bs]


# Variants of ours timed beside it, A / B in one run: side name -> (the cases that time it, its table column)
VARIANTS = {
    "ours_logits_loss": (("train_step",), "ours, loss from the logits"),
    "ours_transformers_experts": (("train_step", "prefill"), "ours, transformers' grouped_mm experts"),
}


def set_up_side(model, side):
    """Ours as `side`: itself, or one of `VARIANTS` (the loss from the logits, as transformers computes it; the
    routed experts on transformers' grouped_mm, their modules on the PyTorch backend, the rest on our kernels)."""
    from kda_moe.modeling.modeling_kda_moe import KdaMoeExperts

    model.config.fused_linear_cross_entropy = side != "ours_logits_loss"
    for module in model.modules():
        if isinstance(module, KdaMoeExperts):
            module.backend = "torch" if side == "ours_transformers_experts" else model.config.kernel_backend


def cell(result, key, unit):
    """A table cell: the throughput (peak GB), the error's start, or "-"."""
    if key in result:
        peak = result.get("peak_GB")
        return f"{result[key]:,.0f} {unit}" + (f" ({peak:.1f})" if peak is not None else "")
    return result["error"][:80] if "error" in result else "-"


def write_tables(res, out):
    """OUTDIR/model_bench.md and model_bench.json from what ``res`` holds so far; returns the markdown."""
    md = [f"GPU: {res['gpu']}; torch {res['torch']}, transformers {res['transformers']}; {res['params'] / 1e6:.0f}M "
          f"parameters; fp32 logits, ours against transformers': {res['logits_rel_err']:.1e}, against our PyTorch "
          f"backend: {res['logits_rel_err_torch_backend']:.1e}.", "",
          "| case | transformers + fla | ours | ours / transformers (throughput) | peak GB: transformers / ours | "
          + " | ".join(f"{column} (peak GB)" for _, column in VARIANTS.values()) + " |",
          "|---|---|---|---|---|" + "---|" * len(VARIANTS)]
    for row in res["rows"]:
        key = "decode_tok_s" if row["case"] == "generate" else "tok_s"
        unit = "tokens/s decoded" if row["case"] == "generate" else "tokens/s"
        sides = [row.get(side, {}) for side in ("theirs", "ours")]
        cells = [f"{s[key]:,.0f} {unit}" if key in s else s.get("error", "-")[:80] for s in sides]
        ratio = f"{sides[1][key] / sides[0][key]:.2f}x" if all(key in s for s in sides) else "-"
        peaks = " / ".join(f"{s['peak_GB']:.1f}" if s.get("peak_GB") is not None else "-" for s in sides)
        variants = " | ".join(cell(row.get(side, {}), key, unit) for side in VARIANTS)
        md.append(f"| {row['case']} {'x'.join(map(str, row['shape']))} | {cells[0]} | {cells[1]} | {ratio} | {peaks} "
                  f"| {variants} |")  # fmt: skip
    text = "\n".join(md)
    open(os.path.join(out, "model_bench.md"), "w").write(text + "\n")
    json.dump(res, open(os.path.join(out, "model_bench.json"), "w"), indent=1)
    return text


def main(out, profile=False, kinds=None):
    import transformers

    os.makedirs(out, exist_ok=True)
    config = anchor_config()
    with tempfile.TemporaryDirectory() as folder:
        theirs, ours = build_models(config, folder)
        ours_on_torch = KdaMoeForCausalLM.from_pretrained(folder, kernel_backend="torch").to(dev)
    res = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else dev, torch=torch.__version__,
               transformers=transformers.__version__, params=sum(p.numel() for p in ours.parameters()), rows=[])
    res["logits_rel_err"], res["logits_rel_err_torch_backend"] = logits_errors(
        ours, [theirs, ours_on_torch], config.vocab_size)
    del ours_on_torch
    log(f"fp32 logits, ours against transformers': {res['logits_rel_err']:.1e}, against our PyTorch backend: "
        f"{res['logits_rel_err_torch_backend']:.1e}")
    models = {"theirs": theirs.to(torch.bfloat16), "ours": ours.to(torch.bfloat16)}
    if profile:
        shape = next(shape for case, shape in CASES if case == "train_step")
        for side, model in models.items():
            log(f"profile of a training step {shape}, {side}: start")
            table = profile_train_step(model, shape, config.vocab_size)
            open(os.path.join(out, f"model_profile_{side}.txt"), "w").write(table + "\n")
            print(table, flush=True)
        return
    for case, shape in CASES:
        if kinds and case not in kinds:
            continue
        row = dict(case=case, shape=list(shape))
        res["rows"].append(row)
        variants = [(side, models["ours"]) for side, (cases, _) in VARIANTS.items() if case in cases]
        for side, model in list(models.items()) + variants:
            if side != "theirs":
                set_up_side(model, side)
            log(f"{case} {shape} {side}: start")
            try:
                row[side] = run_case(model, case, shape, config.vocab_size)
            except Exception:  # noqa: BLE001
                row[side] = dict(error=traceback.format_exc(limit=3)[-600:])
            log(f"{case} {shape} {side}: {row[side]}")
            if dev == "cuda":
                torch.cuda.empty_cache()
            write_tables(res, out)  # after every side of every case: a call cut short still leaves its table
    print(write_tables(res, out))


if __name__ == "__main__":
    picked = [a.split("=", 1)[1].split(",") for a in sys.argv[2:] if a.startswith("cases=")]
    main(sys.argv[1] if len(sys.argv) > 1 else ".", profile="profile" in sys.argv[2:], kinds=picked[0] if picked else None)
