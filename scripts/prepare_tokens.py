"""Text to token files for ``data=tokens``: train.bin + val.bin + meta.json in --out.

    python scripts/prepare_tokens.py --out data/mytext --files notes.txt corpus/      # byte-level
    python scripts/prepare_tokens.py --out data/owt --hf Skylion007/openwebtext --tokenizer gpt2
    python scripts/prepare_tokens.py --out data/wt103 --hf wikitext --hf-config wikitext-103-raw-v1 \\
        --val-split validation --no-eot --tokenizer gpt2

Each local file, or each row of a Hugging Face data set, is one document, ended by the
end-of-text token (gpt2: 50256; byte: 0xFF, a byte UTF-8 text never contains). Then train with
    python train.py model=gpt2_s data=tokens data.path=data/owt/train.bin
Offline, a --hf name must already be in the Hugging Face cache (or use --hf-disk with a folder
written by save_to_disk), and --tokenizer gpt2 needs tiktoken's cached files (TIKTOKEN_CACHE_DIR).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stabletrain.config import ConfigError
from stabletrain.data.token_files import prepare_from_sources


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder for train.bin, val.bin, meta.json")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--files", nargs="+", help="text files and folders (all files under them, sorted)")
    src.add_argument("--hf", help="Hugging Face data set name, e.g. Skylion007/openwebtext or wikitext")
    src.add_argument("--hf-disk", help="a folder written by datasets' save_to_disk")
    ap.add_argument("--hf-config", help="the data set's config, e.g. wikitext-103-raw-v1")
    ap.add_argument("--hf-revision", help="a revision of the --hf repository, e.g. refs/convert/parquet")
    ap.add_argument("--split", default="train", help="split for train.bin (default train)")
    ap.add_argument("--val-split", help="a split for val.bin (e.g. validation) instead of --val-fraction")
    ap.add_argument("--text-field", default="text", help="column holding the text (default text)")
    ap.add_argument("--tokenizer", default="byte", choices=["byte", "gpt2"])
    ap.add_argument("--val-fraction", type=float, default=0.0005,
                    help="share of the documents drawn at random for val.bin (default 0.0005, nanoGPT's); "
                         "with --no-eot, the share of the stream's end")
    ap.add_argument("--seed", type=int, default=0, help="seed of the validation draw (default 0)")
    ap.add_argument("--block-size", type=int, default=1024,
                    help="the model's context: val.bin gets at least block_size + 2 tokens (default 1024)")
    ap.add_argument("--no-eot", action="store_true",
                    help="concatenate documents without end-of-text tokens (WikiText: rows are lines of one text)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    if a.block_size < 1:
        print(f"error: --block-size {a.block_size} must be >= 1: the model's context (model.block_size)",
              file=sys.stderr)
        return 2
    if Path(a.out).exists() and not Path(a.out).is_dir():
        print(f"error: --out {a.out} is a file; give a folder for train.bin, val.bin and meta.json", file=sys.stderr)
        return 2
    try:
        meta = prepare_from_sources(
            a.out, files=a.files, hf=a.hf, hf_config=a.hf_config, hf_disk=a.hf_disk, hf_revision=a.hf_revision,
            split=a.split, val_split=a.val_split, text_field=a.text_field, tokenizer=a.tokenizer,
            val_fraction=a.val_fraction, seed=a.seed, block_size=a.block_size, eot=not a.no_eot, progress=not a.quiet)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.out}: {meta['train_tokens']} train and {meta['val_tokens']} val tokens "
          f"({meta['tokenizer']}, vocab {meta['vocab_size']}, {meta['dtype']})")
    if meta.get("val_documents") == 0 and meta.get("train_documents", 0) > 0:
        # no document was drawn for validation: val.bin is the end of the training stream
        print(f"note: no document was drawn for validation (--val-fraction {a.val_fraction:g} of "
              f"{meta['train_documents']} documents): val.bin is the last {meta['val_tokens']} tokens of the text, "
              f"cut from the end of train; more documents or a larger --val-fraction draw whole ones",
              file=sys.stderr)
    if skipped := meta.get("skipped_files"):
        print(f"skipped {len(skipped)} file(s) that are not UTF-8 text, e.g. {skipped[0]} "
              f"(all listed in {Path(a.out) / 'meta.json'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
