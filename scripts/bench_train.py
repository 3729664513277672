"""The performance goals in one run: the trainer against a bare loop, and what each fix costs.

    python scripts/bench_train.py                       # GPT-2 S 16 x 1024 and ViT-B/16 batch 256, compiled, bf16
    python scripts/bench_train.py --eager               # the same without torch.compile
    python scripts/bench_train.py --profile trainer     # + a torch profiler trace of one variant's steps
    python scripts/bench_train.py --models gpt2_s --batch 64 --extra micro_batch_size=16   # 4 micro-batches a step
    python scripts/bench_train.py --models vit_test,gpt_test --device cpu --steps 2 --warmup 1   # smoke run

Every row times full training steps (forward, loss, backward, optimizer) on a batch resident on
the device, back to back: ``--steps`` steps between two synchronisations, the median of three
such runs after ``--warmup`` steps, so the host runs ahead of the device as in training.

- ``bare``: what a hand-written nanoGPT / timm loop does: the model and its cross-entropy in one
  ``torch.compile``d function, torch's fused AdamW, autocast, backward, step, zero_grad;
- ``trainer``: ``Trainer.train_step`` with ``optim=adamw`` (fused) and the defaults otherwise
  (the schedule, non-finite step skipping, the compiled loss); ``trainer no-skip``: with
  ``divergence.skip_nonfinite=false`` (the per-step gradient norm and its flag off);
- ``adamw2``, ``adamw2 overlap`` (``optim.overlap_sigma_w=true``), ``sigma`` (``reparam=sigma``
  with AdamW): each against ``trainer``;
- ``monitors``: one weight-side pass and one probe pass, amortised over their default cadence
  (``monitor.weight_every`` / ``monitor.probe_every``), as a share of the trainer's step.

MFU counts the model's training FLOPs per sample (nanoGPT's ``6 N + 12 L H d_h T`` per token for
a GPT) against the device's dense bf16 peak. Prints one markdown table per model with the goal
each ratio is held to.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stabletrain.build import build_trainer  # noqa: E402
from stabletrain.cli import checked_config  # noqa: E402
from stabletrain.config import MonitorConfig  # noqa: E402
from stabletrain.errors import ConfigError  # noqa: E402
from stabletrain.metrics import peak_flops  # noqa: E402

# variant -> (overrides on top of optim=adamw, the row it is compared with, the goal for the ratio)
VARIANTS = {
    "trainer": ([], "bare", "<= +3%"),
    "trainer no-skip": (["divergence.skip_nonfinite=false"], "trainer", ""),
    "adamw2": (["optim=adamw2"], "trainer", "<= +3%"),
    "adamw2 overlap": (["optim=adamw2", "optim.overlap_sigma_w=true"], "trainer", "<= +3%"),
    "sigma": (["reparam=sigma"], "trainer", "<= +10%"),
}
DEFAULT_BATCH = {"gpt": 16, "vit": 256}


def steps_time(fn, steps: int, warmup: int, sync) -> float:
    """Seconds per call of ``fn``: ``steps`` calls between two syncs, the median of three runs."""
    for _ in range(warmup):
        fn()
    sync()
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        runs.append((time.perf_counter() - t0) / steps)
    return statistics.median(runs)


def overrides(model: str, args) -> list[str]:
    gpt = model.startswith("gpt")
    batch = args.batch or DEFAULT_BATCH["gpt" if gpt else "vit"]
    over = [f"model={model}", "optim=adamw", "logger=none", f"device={args.device}", f"batch_size={batch}",
            f"compile={str(not args.eager).lower()}", "eval_every=1000000", "ckpt_every=1000000"]
    if gpt:
        over += [f"model.block_size={args.seq}"]
    elif "test" not in model:
        over += ["data=digits", "data.img_size=224"]
    return over + args.extra


def free() -> None:
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profiled(fn, steps: int, path: Path, sync) -> None:
    """A torch profiler trace of ``steps`` calls (open it in Perfetto / chrome://tracing) and the
    top kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        with record_function(STEPS):
            for _ in range(steps):
                fn()
        sync()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25))
    print(timeline(prof.events(), steps))
    print(f"trace: {path}")


# the host's range of the traced steps, without the sync that ends them (nor the profiler's own at its exit)
STEPS = "bench_train: steps"
# the CUDA runtime calls in which the host waits for the device (a .item() is a copy and a stream sync)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def timeline(events, steps: int) -> str:
    """Where the gap goes, from a trace: the host's work a step (aten ops it dispatched, device
    operations it queued, times it waited for the device) and the share of the time from the
    first step's start to the last kernel's end that the device was busy (an idle device while
    the host is busy means the step is host-bound)."""
    (span,) = [e.time_range for e in events if e.name == STEPS and e.device_type == DeviceType.CPU]
    aten = [e for e in events if e.name.startswith("aten::")]
    ops = sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    # kernels, copies and fills; not the device-side shadows of annotated ranges (an optimizer's
    # step, a compiled graph), whose spans cover the gaps between their kernels
    kernels = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    waits = sum(1 for e in events if e.name in SYNCS and span.start <= e.time_range.start < span.end)
    line = f"{steps} steps traced: {ops / steps:.0f} aten ops"
    if not kernels:
        return line + " a step (no device kernels: a CPU run)"
    end = max(e for _, e in kernels)
    return (f"{line}, {len(kernels) / steps:.0f} device ops and {waits / steps:.1f} host waits a step; "
            f"the device busy {busy_share(kernels, span.start, end):.1%} of the traced time")


def busy_share(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """The share of ``[start, end]`` covered by the union of ``intervals`` (kernels may overlap
    across streams)."""
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered / (end - start) if end > start else 0.0


def bare_loop(t, batch, args):
    """The hand-written loop on the trainer's model: model and loss compiled as one function."""
    raw = t.model
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-4, fused=t.device.type in ("cuda", "cpu"))  # as optim=adamw

    def loss_of(x, y):
        with torch.autocast(t.device.type, dtype=torch.bfloat16, enabled=t.bf16):
            out = raw(x)
        return F.cross_entropy(out.float().flatten(0, -2), y.flatten())

    loss_fn = loss_of if args.eager else torch.compile(loss_of)

    def step():
        for x, y in batch:
            loss_fn(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def trainer_step(t, batch):
    def step():
        t.train_step(batch, False)
        t.step += 1  # the schedule moves on, as in training

    return step


def bench(model: str, args) -> tuple[dict, dict]:
    base = overrides(model, args)
    rows: dict[str, dict] = {}
    meta: dict = {}
    # the profiled row last: the profiler leaves the CUDA runtime slower per launch for the rest of
    # the process (on one H200, rows timed after a profiled one were up to 45% slower)
    traced = "trainer" if args.profile == "bare" else args.profile
    for name in sorted(VARIANTS, key=lambda v: v == traced):
        extra = VARIANTS[name][0]
        if args.variants and name not in args.variants:
            continue
        first = name == "trainer"  # also times the monitors and the bare loop on its model
        own = {o.split("=")[0] for o in extra}
        cfg = checked_config([o for o in base if o.split("=")[0] not in own] + extra
                             + [f"monitor={'standard' if first else 'off'}"])
        t = build_trainer(cfg, Path(args.out) / model / name.replace(" ", "_").replace(",", ""))
        sync = torch.cuda.synchronize if t.device.type == "cuda" else (lambda: None)
        batch = [t._to_device(x, y) for x, y in next(t.data.train_iter(0, t.shard))]
        meta.update(batch=cfg.batch_size, micro=len(batch), unit=t.data.seq_len or 1, kind=t.data.kind,
                    flops=t.settings.flops_per_sample, device=t.device)
        timed = {name: trainer_step(t, batch)}
        if first:
            d = MonitorConfig()
            weight = steps_time(t.monitor.weight_metrics, 1, 1, sync)
            probe = steps_time(t.monitor.probe_metrics, 1, 1, sync)
            meta["monitors"] = (weight / d.weight_every + probe / d.probe_every, weight, probe)
            timed["bare"] = bare_loop(t, batch, args)
            if args.profile == name:
                timed = {"bare": timed.pop("bare"), name: timed[name]}
        for key, fn in timed.items():
            cuda = t.device.type == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            rows[key] = {"s": steps_time(fn, args.steps, args.warmup, sync),
                         "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
            # as it goes: a long run cut short still says what it timed
            print(f"{model} {key}: {1e3 * rows[key]['s']:.1f} ms/step", file=sys.stderr, flush=True)
            if args.profile == key:
                profiled(fn, 5, Path(args.out) / model / "trace.json", sync)
        del timed, t, batch
        free()
    return rows, meta


def report(model: str, rows: dict, meta: dict, args) -> None:
    dev = meta["device"]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    peak = peak_flops(name) if dev.type == "cuda" else None
    micro = f" in {meta['micro']} micro-batches" if meta["micro"] > 1 else ""
    print(f"\n{model}: {name}, batch {meta['batch']}{micro}, {'eager' if args.eager else 'torch.compile'}"
          f"{', bf16' if dev.type == 'cuda' else ''}{''.join(f', {o}' for o in args.extra)}\n")
    unit = "tokens/s" if meta["kind"] == "text" else "images/s"
    print(f"| variant | ms/step | against | ratio | goal | {unit} | MFU | peak GiB |")
    print("| --- | ---: | --- | ---: | --- | ---: | ---: | ---: |")
    order = ["bare"] + [v for v in VARIANTS if v in rows]
    for v in order:
        s = rows[v]["s"]
        against, goal = ("", "") if v == "bare" else VARIANTS[v][1:]
        ratio = f"{100 * (s / rows[against]['s'] - 1):+.1f}%" if against in rows else ""
        per_s = meta["batch"] * meta["unit"] / s
        mfu = f"{meta['flops'] * meta['batch'] / s / peak:.1%}" if peak and meta["flops"] else ""
        mem = rows[v]["peak_gb"]
        print(f"| {v} | {1e3 * s:.1f} | {against} | {ratio} | {goal} | {per_s:,.0f} | {mfu} | "
              f"{'' if mem is None else f'{mem:.1f}'} |")
    if dev.type != "cuda":
        print("\nnote: on a CPU this checks that each variant runs; the goals are set for one GPU, and "
              "'adamw2 overlap' has no side stream here (the same work as 'adamw2')")
    if "monitors" in meta and "trainer" in rows:
        share, weight, probe = meta["monitors"]
        print(f"| monitors (weight pass {1e3 * weight:.1f} ms, probe pass {1e3 * probe:.1f} ms) | | trainer | "
              f"{100 * share / rows['trainer']['s']:+.2f}% | <= +2% | | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2_s,vit_b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=None, help="per model default: GPT 16 sequences, ViT 256 images")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed run (three runs, the median)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--variants", default="", help=f"comma list of {', '.join(VARIANTS)} (default all)")
    ap.add_argument("--profile", default=None, help="profile 5 steps of one variant (or bare)")
    ap.add_argument("--out", default="/tmp/bench_train", help="run directories and the profiler's trace.json")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every row (a variant's own win), "
                    "e.g. micro_batch_size=16 to time gradient accumulation")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: bench_train.py times training on a GPU and no CUDA GPU is visible here; "
                 "--models vit_test,gpt_test --device cpu --steps 2 --warmup 1 is a smoke run of it on a CPU")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"error: --variants {unknown[0]} is not a variant; choose from: {', '.join(VARIANTS)}")
    if args.profile is not None and args.profile not in ("bare", *VARIANTS):
        sys.exit(f"error: --profile {args.profile} is not a variant; choose bare or one of: {', '.join(VARIANTS)}")
    for flag, value in (("--batch", args.batch), ("--seq", args.seq), ("--steps", args.steps)):
        if value is not None and value < 1:
            sys.exit(f"error: {flag}={value} must be at least 1")
    if args.warmup < 0:
        sys.exit(f"error: --warmup={args.warmup} must be 0 or more")
    if args.variants and "trainer" not in args.variants:
        args.variants.insert(0, "trainer")  # every ratio is against it (and bare)
    for model in args.models.split(","):
        try:
            rows, meta = bench(model, args)
        except ConfigError as e:  # e.g. --device cuda without a GPU
            sys.exit(f"error: {e}")
        report(model, rows, meta, args)


if __name__ == "__main__":
    main()
