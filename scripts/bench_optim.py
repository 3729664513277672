"""Time AdamW² against fused AdamW on full bf16 training steps, and power iteration alone.

    python scripts/bench_optim.py                       # ViT-B/16 batch 256, GPT-2 S 16x1024, H100
    python scripts/bench_optim.py --compile --steps 30
    python scripts/bench_optim.py --optims adamw,adamw2,adamw2-overlap
    python scripts/bench_optim.py --models gpt --accum 4   # 4 micro-batches per optimizer step
    python scripts/bench_optim.py --device cpu --tiny   # smoke test of this script
    python scripts/bench_optim.py --device cpu --optimizer-only --skip-power   # step() alone

A step is forward + backward under bf16 autocast (fp32 master weights), ``--accum`` times
(gradient accumulation, as a recipe batch larger than one micro-batch runs), + optimizer step +
zero_grad. Times are medians of per-step CUDA events after warm-up; "optimizer" is the
``step()`` call alone on the main stream. Variants: ``adamw`` (torch fused),
``adamw-foreach``, ``adamw2`` (fused direction), ``adamw2-foreach`` (fused=False),
``adamw2-cold`` (warm_start=False), ``adamw2-overlap`` (overlap_sigma_w=True: sigma1(W) on a
side stream during the next forward and backward).
Prints a markdown table; the target is AdamW² within 3% of fused AdamW on ViT-B.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stabletrain.optim import build_optimizer
from stabletrain.spectral import as_matrix, batched_sigma1, power_iteration, random_unit

VARIANTS = {
    "adamw": {"name": "adamw", "fused": None},
    "adamw-foreach": {"name": "adamw", "fused": False},
    "adamw2": {"name": "adamw2", "fused": None},
    "adamw2-foreach": {"name": "adamw2", "fused": False},
    "adamw2-cold": {"name": "adamw2", "fused": None, "warm_start": False},
    "adamw2-overlap": {"name": "adamw2", "fused": None, "overlap_sigma_w": True},
}


def optim_cfg(**over) -> SimpleNamespace:
    """The fields of config.OptimConfig that build_optimizer reads (no Hydra needed)."""
    base = {
        "name": "adamw2",
        "lr": 1e-3,
        "weight_decay": 0.05,
        "betas": [0.9, 0.99],
        "eps": 1e-8,
        "tau": 0.004,
        "eps_inside_sqrt": False,
        "power_iters": 3,
        "warm_start": True,
        "bound_norm_gains": True,
        "momentum": 0.9,
        "nesterov": False,
        "trust_coef": 0.001,
        "lr_scale_by_batch": False,
        "fused": None,
        "overlap_sigma_w": False,
    }
    base.update(over)
    return SimpleNamespace(**base)


# --- models ---------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LocalGPT(nn.Module):
    """nanoGPT's shape (no biases, tied embeddings) for when stabletrain's GPT cannot load."""

    def __init__(self, vocab, ctx, depth, d, heads):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def build_gpt(vocab, ctx, depth, d, heads):
    try:
        from stabletrain.config import ModelConfig
        from stabletrain.models.gpt import GPT

        model_cfg = ModelConfig(
            name="gpt_bench",
            family="gpt",
            vocab_size=vocab,
            block_size=ctx,
            depth=depth,
            embed_dim=d,
            num_heads=heads,
        )
        return GPT(model_cfg), "stabletrain.models.gpt"
    except ImportError as err:  # omegaconf/Hydra may be absent on a bench machine
        print(f"(stabletrain GPT unavailable: {type(err).__name__}: {err}; using the local GPT)")
        return LocalGPT(vocab, ctx, depth, d, heads), "local"


def make_workload(kind: str, args, device):
    """(model, family, batch maker, loss, label) for 'vit' or 'gpt'."""
    if kind == "vit":
        import timm

        if args.tiny:
            model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10)
            shape, classes = (args.batch, 3, 32, 32), 10
        else:
            model = timm.create_model("vit_base_patch16_224", num_classes=1000)
            shape, classes = (args.batch, 3, 224, 224), 1000
        x = torch.randn(shape, device=device)
        y = torch.randint(0, classes, (args.batch,), device=device)
        label = f"ViT-{'tiny' if args.tiny else 'B/16'} b{args.batch}"
        return model, "vit", lambda m: F.cross_entropy(m(x), y), label
    vocab, ctx, depth, d, heads = (256, 64, 2, 64, 4) if args.tiny else (50304, 1024, 12, 768, 12)
    model, impl = build_gpt(vocab, ctx, depth, d, heads)
    idx = torch.randint(0, vocab, (args.gpt_batch, ctx + 1), device=device)

    def loss(m):
        logits = m(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))

    label = f"GPT-{'tiny' if args.tiny else '2 S'} {args.gpt_batch}x{ctx} ({impl})"
    return model, "gpt", loss, label


# --- timing ---------------------------------------------------------------------------------


class Timer:
    """Per-region timings: CUDA events on a GPU, perf_counter after a sync elsewhere."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return (start, ev)
        return (time.perf_counter() - start) * 1e3

    def collect(self, marks):
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in marks]
        return marks


def time_training(kind, variant, args, device):
    torch.manual_seed(0)
    model, family, loss_fn, label = make_workload(kind, args, device)
    model = model.to(device)
    opt, _ = build_optimizer(model, optim_cfg(**VARIANTS[variant], power_iters=args.power_iters), family)
    run = torch.compile(model) if args.compile else model
    timer = Timer(device)
    step_marks, opt_marks = [], []
    for i in range(args.warmup + args.steps):
        t0 = timer.start()
        for _ in range(args.accum):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(run) / args.accum
            loss.backward()
        t1 = timer.start()
        opt.step()
        t2 = timer.stop(t1)
        opt.zero_grad(set_to_none=True)
        t3 = timer.stop(t0)
        if i >= args.warmup:
            step_marks.append(t3)
            opt_marks.append(t2)
    steps, opts = timer.collect(step_marks), timer.collect(opt_marks)
    if not math.isfinite(loss.item()):
        raise RuntimeError(f"{label} {variant}: loss is not finite")
    extra = ""
    if hasattr(opt, "bound_stats"):
        extra = f"bound {opt.bound_stats()['bound_fraction']:.2f}"
    del model, opt, run
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return label, statistics.median(steps), statistics.median(opts), extra


def time_optimizer_only(kind, variant, args, device):
    """``step()`` alone on the model's parameters with fixed random gradients (no forward)."""
    torch.manual_seed(0)
    model, family, _, label = make_workload(kind, args, device)
    model = model.to(device)
    opt, _ = build_optimizer(model, optim_cfg(**VARIANTS[variant], power_iters=args.power_iters), family)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    timer = Timer(device)
    marks = []
    for i in range(args.warmup + args.steps):
        t = timer.start()
        opt.step()
        if i >= args.warmup:
            marks.append(timer.stop(t))
    ms = statistics.median(timer.collect(marks))
    del model, opt
    return label, ms


def time_power_iteration(args, device):
    """sigma1 of ViT-B's matrices (and as many Adam directions): one batched call vs a loop."""
    import timm

    torch.manual_seed(0)
    if args.tiny:
        model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10)
    else:
        model = timm.create_model("vit_base_patch16_224", num_classes=1000)
    mats = [as_matrix(p.detach()).to(device) for p in model.parameters() if as_matrix(p).dim() >= 2]
    mats = mats + [torch.randn_like(m) for m in mats]  # stand-ins for the directions U
    vecs = [(random_unit(m.shape[0], device=device), random_unit(m.shape[1], device=device)) for m in mats]
    timer = Timer(device)

    def batched():
        batched_sigma1(mats, vecs, iters=args.power_iters)

    def looped():
        for m, (u, v) in zip(mats, vecs):
            power_iteration(m, u, v, args.power_iters)

    rows = []
    for label, fn in (("batched by shape", batched), ("per-tensor loop", looped)):
        marks = []
        for i in range(args.warmup + args.steps):
            t = timer.start()
            fn()
            if i >= args.warmup:
                marks.append(timer.stop(t))
        rows.append((label, statistics.median(timer.collect(marks))))
    return len(mats), rows


def profile_optimizer(kind, variant, args, device):
    """Top device kernels of a few optimizer steps (after warm-up), by total time."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model, family, loss_fn, label = make_workload(kind, args, device)
    model = model.to(device)
    opt, _ = build_optimizer(model, optim_cfg(**VARIANTS[variant], power_iters=args.power_iters), family)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = loss_fn(model)
    loss.backward()
    for _ in range(3):
        opt.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\n{label} {variant}: 3 optimizer steps")
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small models for a quick smoke run")
    ap.add_argument("--batch", type=int, default=None, help="ViT batch (default 256, tiny 4)")
    ap.add_argument("--gpt-batch", type=int, default=None, help="GPT sequences per step (default 16, tiny 2)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches (forward + backward) per optimizer step")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (not the optimizer)")
    ap.add_argument("--models", default="vit,gpt")
    ap.add_argument("--optims", default="adamw,adamw2", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--power-iters", type=int, default=3)
    ap.add_argument("--skip-power", action="store_true", help="skip the power-iteration micro-benchmark")
    ap.add_argument("--optimizer-only", action="store_true",
                    help="time step() alone with random gradients: no forward or backward (fits a CPU)")
    ap.add_argument("--profile", default=None, help="profile the optimizer steps of one variant, e.g. adamw2")
    args = ap.parse_args(argv)
    args.batch = args.batch or (4 if args.tiny else 256)
    args.gpt_batch = args.gpt_batch or (2 if args.tiny else 16)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        sys.exit(f"error: --device {args.device} is not a device: use cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("error: bench_optim.py times the optimizer on a GPU and no CUDA GPU is visible here; "
                     "--device cpu --tiny is a smoke run of the script on a CPU")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    variants = [v.strip() for v in args.optims.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"error: --optims {unknown[0]} is not a variant; choose from: {', '.join(VARIANTS)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in ("vit", "gpt") for m in models):
        sys.exit(f"error: --models {args.models}: this script builds its own two models, vit and gpt (--tiny: "
                 f"small ones); a model of the configs (vit_test, gpt2_s) is bench_train.py's --models")
    if args.profile is not None and args.profile not in VARIANTS:
        sys.exit(f"error: --profile {args.profile} is not a variant; choose from: {', '.join(VARIANTS)}")
    for flag, value in (("--steps", args.steps), ("--accum", args.accum), ("--batch", args.batch),
                        ("--gpt-batch", args.gpt_batch), ("--power-iters", args.power_iters)):
        if value < 1:
            sys.exit(f"error: {flag}={value} must be at least 1")
    if args.warmup < 0:
        sys.exit(f"error: --warmup={args.warmup} must be 0 or more")

    lines = [
        "| model | optimizer | step ms | optimizer ms | vs adamw | note |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    if args.optimizer_only:
        lines = ["| model | optimizer | optimizer step ms | vs adamw |", "| --- | --- | ---: | ---: |"]
    for kind in models:
        base = None
        for variant in variants:
            if args.optimizer_only:
                label, opt_ms = time_optimizer_only(kind, variant, args, device)
                base = opt_ms if variant == "adamw" else base
                rel = f"{opt_ms / base:.2f}x" if base else ""
                lines.append(f"| {label} | {variant} | {opt_ms:.2f} | {rel} |")
                print(lines[-1], flush=True)
                continue
            label, step_ms, opt_ms, note = time_training(kind, variant, args, device)
            if variant == "adamw":
                base = step_ms
            rel = f"{100 * (step_ms / base - 1):+.1f}%" if base else ""
            lines.append(f"| {label} | {variant} | {step_ms:.2f} | {opt_ms:.2f} | {rel} | {note} |")
            print(lines[-1], flush=True)
    if not args.skip_power:
        n, rows = time_power_iteration(args, device)
        lines.append("")
        lines.append(f"| power iteration ({n} matrices, {args.power_iters} iters) | ms |")
        lines.append("| --- | ---: |")
        lines += [f"| {label} | {ms:.3f} |" for label, ms in rows]
    if args.profile:
        for kind in models:
            profile_optimizer(kind, args.profile, args, device)
    print()
    print(f"compile={args.compile} steps={args.steps} warmup={args.warmup} power_iters={args.power_iters} "
          f"accum={args.accum}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
