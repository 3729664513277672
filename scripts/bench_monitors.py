"""Cost of the monitors alone: one weight-side pass and one probe pass.

    python scripts/bench_monitors.py --model vit_b --device cuda
    python scripts/bench_monitors.py --model gpt2_s --device cuda --seq 1024
    python scripts/bench_monitors.py --model vit_test --device cpu      # smoke run

Builds the run's ``Trainer`` (so the monitor sees exactly the model training would, TF32 and
all), then times ``MonitorRunner.weight_metrics`` and ``MonitorRunner.probe_metrics``:
medians of wall time over ``--repeats`` calls after ``--warmup`` calls (CUDA-synchronised).
The first weight pass is cold (random power-iteration starts, more iterations) and reported
apart; later passes are warm-started, as in training.

Host syncs per pass: calls of ``Tensor.item``, ``tolist``, ``__float__``/``__int__``/``__bool__``,
``cpu`` and ``numpy``. "device" counts those on non-CPU tensors (each one a device->host copy
and a sync), "all" also those on host tensors (free, but each would be a sync if the data
still lived on the device; on ``--device cpu`` it is the only meaningful column).

The weight pass is also split into phases (from wrapping two functions of
``stabletrain.monitor.quantities``): ``launch`` (Python until the results are fetched: the
stacking, Grams and power iterations queued on the device), ``fetch`` (waiting for the device
plus the one device-to-host copy), ``eig`` (per-head ``d_h x d_h`` eigenvalues on the CPU) and
``rest`` (assembling the metric dict).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stabletrain.cli import checked_config  # noqa: E402
from stabletrain.build import build_trainer  # noqa: E402
from stabletrain.errors import ConfigError  # noqa: E402
from stabletrain.monitor import quantities as Q  # noqa: E402

SYNC_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


@contextlib.contextmanager
def count_syncs():
    """Count calls of the Tensor methods that read tensor data on the host: ``counts[m]`` for
    all tensors, ``counts["device"]`` those on a non-CPU device (real syncs)."""
    counts = {m: 0 for m in SYNC_METHODS}
    counts["device"] = 0
    saved = {m: getattr(torch.Tensor, m) for m in SYNC_METHODS}

    def wrap(name, fn):
        def inner(self, *a, **k):
            counts[name] += 1
            if self.device.type != "cpu":
                counts["device"] += 1
            return fn(self, *a, **k)
        return inner

    for m in SYNC_METHODS:
        setattr(torch.Tensor, m, wrap(m, saved[m]))
    try:
        yield counts
    finally:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, fn)


@contextlib.contextmanager
def phase_timer():
    """Wall time spent in ``quantities._to_host`` and ``quantities._host_spectra`` per call."""
    spent = {"fetch": 0.0, "eig": 0.0, "launch_end": None}
    orig_fetch, orig_eig = Q._to_host, Q._host_spectra

    def fetch(*a, **k):
        t0 = time.perf_counter()
        spent["launch_end"] = t0
        try:
            return orig_fetch(*a, **k)
        finally:
            spent["fetch"] += time.perf_counter() - t0

    def eig(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig_eig(*a, **k)
        finally:
            spent["eig"] += time.perf_counter() - t0

    Q._to_host, Q._host_spectra = fetch, eig
    try:
        yield spent
    finally:
        Q._to_host, Q._host_spectra = orig_fetch, orig_eig


def timed(fn, repeats: int, warmup: int, sync) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def weight_phases(mon, repeats: int, sync) -> dict[str, float]:
    """Median ms per phase of warm weight passes."""
    rows = []
    for _ in range(repeats):
        with phase_timer() as spent:
            sync()
            t0 = time.perf_counter()
            mon.weight_metrics()
            total = time.perf_counter() - t0
        launch = (spent["launch_end"] or t0) - t0
        rows.append({"launch": launch, "fetch": spent["fetch"], "eig": spent["eig"],
                     "rest": total - launch - spent["fetch"] - spent["eig"], "total": total})
    return {k: 1e3 * statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", type=int, default=1024, help="GPT block size")
    ap.add_argument("--probe-batch", type=int, default=None, help="monitor.probe_batch_size")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--per-head", action="store_true")
    ap.add_argument("--reparam", default="none", help="reparam config (none, sigma, sigma_qk)")
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--out", default="/tmp/bench_monitors")
    ap.add_argument("overrides", nargs="*", help="extra config overrides")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: bench_monitors.py times the monitors on a GPU and no CUDA GPU is visible here; "
                 "--model vit_test --device cpu is a smoke run of it on a CPU")
    for flag, value in (("--repeats", args.repeats), ("--seq", args.seq)):
        if value < 1:
            sys.exit(f"error: {flag}={value} must be at least 1")
    if args.warmup < 0:
        sys.exit(f"error: --warmup={args.warmup} must be 0 or more")

    over = [f"model={args.model}", "monitor=standard", "logger=none", f"device={args.device}",
            f"reparam={args.reparam}", f"monitor.per_head={str(args.per_head).lower()}", "eval_every=1000000"]
    if args.model.startswith("gpt"):
        over.append(f"model.block_size={args.seq}")
    elif "test" not in args.model and "mini" not in args.model:
        over += ["data=digits", "data.img_size=224"]
    if args.probe_batch:
        over.append(f"monitor.probe_batch_size={args.probe_batch}")
    cfg = checked_config(over + list(args.overrides))
    try:
        t = build_trainer(cfg, Path(args.out) / args.model)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    mon = t.monitor
    if mon is None:
        sys.exit("error: monitor=off builds no monitors to time; leave the monitor group as this script sets it")
    sync = torch.cuda.synchronize if t.device.type == "cuda" else (lambda: None)
    nparams = sum(p.numel() for p in t.model.parameters())

    sync()
    t0 = time.perf_counter()
    with count_syncs() as cold_sync:
        rec = mon.weight_metrics()
    sync()
    cold_s = time.perf_counter() - t0
    weight_s, wtimes = timed(mon.weight_metrics, args.repeats, args.warmup, sync)
    with count_syncs() as warm_sync:
        mon.weight_metrics()
    phases = weight_phases(mon, max(3, args.repeats // 2), sync)

    def n_syncs(c):
        return c["device"], sum(c[m] for m in SYNC_METHODS)

    rows = [("weight_metrics (cold, first call)", cold_s, *n_syncs(cold_sync)),
            ("weight_metrics (warm)", weight_s, *n_syncs(warm_sync))]
    if not args.no_probe:
        probe_s, _ = timed(mon.probe_metrics, args.repeats, args.warmup, sync)
        with count_syncs() as psync:
            mon.probe_metrics()
        rows.append(("probe_metrics", probe_s, *n_syncs(psync)))

    dev = torch.cuda.get_device_name() if t.device.type == "cuda" else "CPU"
    print(f"\n{args.model} ({nparams / 1e6:.3g}M params, {len(mon.blocks)} blocks) on {dev}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {len(rec)} weight metrics per pass\n")
    print("| pass | median ms | host syncs (device) | host reads (all) |")
    print("| --- | --- | --- | --- |")
    for name, s, n_dev, n_all in rows:
        print(f"| {name} | {s * 1e3:.1f} | {n_dev} | {n_all} |")
    print(f"\nwarm weight pass times (ms): {', '.join(f'{x * 1e3:.1f}' for x in wtimes)}")
    print("warm weight pass phases (median ms): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    print(f"host reads by method (warm weight pass): "
          f"{ {k: v for k, v in warm_sync.items() if v and k != 'device'} }")


if __name__ == "__main__":
    main()
