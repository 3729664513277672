"""Text from a GPT run: its model continues a prompt, in the tokens it was trained on.

    python scripts/sample.py RUN_DIR [--prompt TEXT] [--tokens 200] [--num 1] [--temperature 0.8]
                             [--top-k 50] [--seed 0] [--ema] [--checkpoint PATH] [--device auto]

The model is built from RUN_DIR/config.yaml (its fixes included) and loaded from
RUN_DIR/checkpoints/last.pt, or --checkpoint (a ring checkpoint, say); --ema samples the run's
weight average. The tokenizer is the run's data's: byte-level for the embedded text, the
prepared files' meta.json for data=tokens (GPT-2's without one, as nanoGPT's files). Each token
is drawn from the softmax of the last position's logits divided by --temperature, among the
--top-k likeliest (--top-k 1: greedy); the context is the last block_size tokens. Reproducible
for a --seed on one machine. The samples go to stdout, one line about the run to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _tokenizer(cfg):
    """``(encode, decode, vocab, start)`` of the run's data: ``start`` begins an empty prompt."""
    from stabletrain.config import ConfigError
    from stabletrain.data import resolve_name
    from stabletrain.data.token_files import META, read_meta
    from stabletrain.data.tokenizer import BYTE_EOT, GPT2_VOCAB, gpt2_encoding
    from stabletrain.models.registry import MODELS

    data = cfg.data
    which = resolve_name(data, MODELS.entry(cfg.model.family).info.get("data"))  # data=auto: the family's
    if which == "tokens":
        meta = Path(data.path or "").with_name(META)
        name = read_meta(meta).get("tokenizer", "gpt2") if meta.is_file() else "gpt2"
    elif which == "pytext":
        name = data.tokenizer
    else:
        raise ConfigError(f"data={which}: sample.py knows the tokenizers of data=pytext and data=tokens only")
    if name == "byte":
        def decode(ids):  # a prepared document ends at BYTE_EOT, which valid UTF-8 never holds
            return bytes(ids).split(bytes([BYTE_EOT]))[0].decode("utf-8", errors="replace")

        return (lambda text: list(text.encode("utf-8"))), decode, 256, [BYTE_EOT]
    if name == "gpt2":
        enc = gpt2_encoding(fallback="a run of data.tokenizer=byte")
        return enc.encode_ordinary, enc.decode, GPT2_VOCAB, [enc.eot_token]
    raise ConfigError(f"the run's tokenizer {name!r} is unknown to sample.py; it reads byte and gpt2")


def load_run(run_dir: Path, checkpoint: Path | None, ema: bool):
    """``(cfg, model, step)``: the run's model with its checkpoint's weights, on the CPU."""
    from omegaconf import OmegaConf

    from stabletrain.config import Components, ConfigError, TrainConfig
    from stabletrain.models.registry import MODELS, build_model
    from stabletrain.models.weights import read_weights
    from stabletrain.registry import import_modules

    yaml = run_dir / "config.yaml"
    if not yaml.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml; give a run directory (its hydra.run.dir)")
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(yaml))
    import_modules(cfg.imports)  # a family of the user's own registers on import
    if MODELS.entry(cfg.model.family).info.get("kind") != "text":
        raise ConfigError(f"{run_dir} trained a {cfg.model.family} model, not a language model: sample.py continues "
                          "text")
    model = build_model(cfg.model, Components.of(cfg))
    source = checkpoint or run_dir / "checkpoints" / "last.pt"
    weights = read_weights(source, average=ema, key="")
    # torch's own error starts "Error(s) in loading state_dict", a line that names no tensor
    mine = model.state_dict()
    odd = [k for k in mine if k not in weights.state or weights.state[k].shape != mine[k].shape]
    if odd:
        raise ConfigError(f"{weights.path}: not a checkpoint of this run's model ({len(odd)} of its {len(mine)} "
                          f"tensors missing or of another shape: {odd[0]}); sample a checkpoint the run wrote, or "
                          "start a run from it with init_weights=PATH")
    model.load_state_dict(weights.state)
    return cfg, model.eval(), weights.step


def generate(model, ids: list[int], tokens: int, temperature: float, top_k: int | None, vocab: int,
             block_size: int, generator):
    """``tokens`` more ids after ``ids``, each drawn from the last position's logits."""
    import torch

    x = torch.tensor([ids], device=next(model.parameters()).device)
    for _ in range(tokens):
        logits = model(x[:, -block_size:])[0, -1, :vocab].float()  # a padded vocabulary's extra rows never drawn
        if top_k is not None and top_k < vocab:
            kth = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(x.device)
        x = torch.cat([x, nxt.view(1, 1)], dim=1)
    return x[0, len(ids):].tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--prompt", default="", help="the text to continue (default: a document's start)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens to draw per sample")
    ap.add_argument("--num", type=int, default=1, help="samples")
    ap.add_argument("--temperature", type=float, default=0.8, help="> 0; lower is more conservative")
    ap.add_argument("--top-k", type=int, default=50, help="draw among the k likeliest tokens (1: greedy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ema", action="store_true", help="the run's weight average (ema.decay), not its live weights")
    ap.add_argument("--checkpoint", type=Path, help="another checkpoint of the run (default checkpoints/last.pt)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    args = ap.parse_args(argv)
    for name, ok, need in (("--tokens", args.tokens >= 1, "at least 1"), ("--num", args.num >= 1, "at least 1"),
                           ("--temperature", args.temperature > 0, "above 0 (--top-k 1 is greedy)"),
                           ("--top-k", args.top_k >= 1, "at least 1")):
        if not ok:
            print(f"error: {name}={getattr(args, name[2:].replace('-', '_'))} must be {need}", file=sys.stderr)
            return 1

    import torch

    from stabletrain.config import ConfigError

    try:
        cfg, model, step = load_run(args.run_dir, args.checkpoint, args.ema)
        encode, decode, vocab, start = _tokenizer(cfg)
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              "cpu" if args.device == "auto" else args.device)
    except (ConfigError, RuntimeError) as e:  # RuntimeError: a checkpoint of another model, a bad device
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    model.to(device)
    ids = encode(args.prompt) if args.prompt else start
    block = cfg.model.block_size
    print(f"{args.run_dir}: {cfg.model.family} at step {step}" + (" (weight average)" if args.ema else "")
          + f", {vocab}-token vocabulary, temperature {args.temperature}, top-k {args.top_k}, seed {args.seed}",
          file=sys.stderr)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        for i in range(args.num):
            out = generate(model, ids, args.tokens, args.temperature, args.top_k, vocab, block, gen)
            print((args.prompt + decode(out)) if args.prompt else decode(out), flush=True)
            if i + 1 < args.num:
                print("-" * 40)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
