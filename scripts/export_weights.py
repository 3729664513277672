"""A run's weights as a plain state dict, for use outside stabletrain (timm, your own code).

    python scripts/export_weights.py RUN_OR_CHECKPOINT OUT.pt [--ema]

SOURCE is a run directory (its checkpoints/last.pt), any checkpoint a run wrote (a sharded run's
reads its last_dcp/), or a state dict. sigmaReparam layers are folded into the weight their
forward applies (gamma W / (u^T W v), with the checkpoint's u, v), so OUT holds what a model
without sigmaReparam holds: the ViT and Swin load it into timm's model of the same shape
(``timm.create_model(name, ...).load_state_dict(torch.load(OUT))``), and ``init_weights=OUT``
starts a run from it. --ema exports the run's weight average instead of its live weights.
Written atomically; only tensors, so ``torch.load(OUT, weights_only=True)`` reads it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="a run directory, a checkpoint a run wrote, or a state dict")
    ap.add_argument("out", type=Path, help="the file to write (torch.save of a state dict)")
    ap.add_argument("--ema", action="store_true", help="the run's weight average (ema.decay), not its live weights")
    args = ap.parse_args(argv)

    import torch

    from stabletrain.errors import ConfigError
    from stabletrain.models.weights import folded, non_finite, read_weights

    if args.out.is_dir():  # os.replace cannot put a file over a folder ("runs/", a run's directory)
        print(f"error: {args.out} is a directory; name the file to write", file=sys.stderr)
        return 1
    if not args.out.parent.is_dir():
        print(f"error: {args.out.parent} is not a directory; create it or write elsewhere", file=sys.stderr)
        return 1
    try:
        src, pt, family, _, step, _ = read_weights(args.source, average=args.ema, key="")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # over the file being read, or beside a run's checkpoint among the run's own (resume and
    # rollbacks read last.pt and its ring): a plain state dict there loses the run's optimizer and average
    out = args.out.resolve()
    if out == pt.resolve():
        print(f"error: {args.out}: it would replace the file being read ({pt}); write elsewhere", file=sys.stderr)
        return 1
    if family is not None and pt.parent.name == "checkpoints" and out.parent == pt.parent.resolve():
        print(f"error: {args.out} is in {pt.parent}, the run's own checkpoints; write elsewhere", file=sys.stderr)
        return 1
    bad = non_finite(src)
    if bad:
        print(f"error: {pt}: {len(bad)} tensor(s) hold non-finite values ({', '.join(bad[:4])}); export a "
              "checkpoint from before the run diverged (its ring: checkpoints/step_*.pt)", file=sys.stderr)
        return 1
    state, n = folded(src)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    try:
        torch.save({k: v.contiguous() for k, v in state.items()}, tmp)
        os.replace(tmp, args.out)
    finally:  # a full disk, an interrupt: no half-written file left beside OUT
        tmp.unlink(missing_ok=True)
    what = "weight average" if args.ema else "weights"
    folds = f", {n} sigmaReparam layer(s) folded into the weights they apply" if n else ""
    at = f" at step {step}" if step is not None else ""  # nanoGPT's ckpt.pt says its iter_num too
    run = f" (a {family} run{at})" if family else f" ({at[1:]})" if at else ""
    print(f"wrote {args.out}: the {what} of {pt}{run}"
          + f", {len(state)} tensors{folds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
