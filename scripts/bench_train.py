"""Framework overhead and monitor cost, measured on real training steps.

    python scripts/bench_train.py --models vit_b,gpt2_s          # on a GPU, bf16
    python scripts/bench_train.py --models vit_test --device cpu --steps 5   # smoke run

For each model it times (medians of per-step wall time after warm-up, CUDA-synchronised):

- ``bare``: the model, torch's fused AdamW and a resident batch in a plain loop (autocast,
  backward, step, zero_grad) — what a hand-written timm / nanoGPT loop does;
- ``trainer``: ``Trainer.train_step`` with ``optim=adamw monitor=off`` on the same batch
  (the framework's hot path: schedule, micro-batching, loss, optional clip, no host sync);
- the monitors: one weight-side pass and one probe pass, amortised over their default
  cadence (``monitor.weight_every`` / ``monitor.probe_every``) as a share of step time.

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_monitors import timed  # noqa: E402  (scripts/ is on sys.path when run as a script)
from stabletrain.config import MonitorConfig  # noqa: E402
from stabletrain.build import build_trainer  # noqa: E402
from stabletrain.cli import compose_config as make_cfg  # noqa: E402


def bench(model: str, args) -> dict:
    over = [f"model={model}", "optim=adamw", "monitor=standard", "logger=none", f"device={args.device}",
            f"batch_size={args.batch}", f"compile={str(args.compile).lower()}", "eval_every=1000000"]
    if model.startswith("gpt"):
        over.append(f"model.block_size={args.seq}")
    else:
        over += ["data=digits", "data.img_size=224"] if "test" not in model else []
    cfg = make_cfg(over)
    t = build_trainer(cfg, Path(args.out) / model)
    sync = torch.cuda.synchronize if t.device.type == "cuda" else (lambda: None)
    batch = next(t.data.train_iter(0, t.shard))
    resident = [t._to_device(x, y) for x, y in batch]

    trainer_s, _ = timed(lambda: t.train_step(resident, False), args.steps, args.warmup, sync)

    model_ = t.train_model
    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-4, fused=t.device.type == "cuda")

    def bare():
        for x, y in resident:
            with torch.autocast(t.device.type, dtype=torch.bfloat16, enabled=t.bf16):
                out = model_(x)
            loss = torch.nn.functional.cross_entropy(out.float().flatten(0, -2), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    bare_s, _ = timed(bare, args.steps, args.warmup, sync)
    mon = t.monitor
    weight_s, _ = timed(mon.weight_metrics, 3, 1, sync)
    probe_s, _ = timed(mon.probe_metrics, 3, 1, sync)
    d = MonitorConfig()
    amortised = (weight_s / d.weight_every + probe_s / d.probe_every) / trainer_s
    return {"model": model, "bare_ms": bare_s * 1e3, "trainer_ms": trainer_s * 1e3,
            "overhead": trainer_s / bare_s - 1, "weight_ms": weight_s * 1e3, "probe_ms": probe_s * 1e3,
            "monitor_share": amortised}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="vit_b,gpt2_s")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default="/tmp/bench_train")
    args = ap.parse_args()
    rows = [bench(m, args) for m in args.models.split(",")]
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"\n{dev}, batch {args.batch}, compile={args.compile}\n")
    print("| model | bare loop ms | trainer ms | overhead | weight monitors ms | probe ms "
          "| monitors at default cadence |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['bare_ms']:.1f} | {r['trainer_ms']:.1f} | {100 * r['overhead']:+.1f}% | "
              f"{r['weight_ms']:.1f} | {r['probe_ms']:.1f} | {100 * r['monitor_share']:.2f}% |")


if __name__ == "__main__":
    main()
