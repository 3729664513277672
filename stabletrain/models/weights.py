"""Starting a run from another run's weights (``init_weights=PATH``): a fine-tune, or a branch
that tries another fix or optimizer on weights already trained.

Only the weights come over: the optimizer state, the schedule, the step count and the data order
start afresh (``resume`` continues a run instead). The source is a run directory (its
``checkpoints/last.pt``), any checkpoint a run wrote (a sharded run's ``last.pt`` reads its
``last_dcp/``), or a saved state dict: ``torch.save(model.state_dict())``, ``{"model": ...}``
or timm's ``{"state_dict": ...}`` (the ViT and Swin here have timm's tensor names), with the
``_orig_mod.`` and ``module.`` prefixes of compiled and DDP-wrapped models dropped; a folder of
another code base holds one of ``_FOREIGN_FILES``. The model family's ``weights`` hook reads its kin
before anything loads: GPT renames nanoGPT's and Hugging Face's GPT-2 tensors; ViT and Swin resample
through timm's own filters the tensors tied to another image, patch or window size (:func:`timm_filter`).

sigmaReparam on either side goes through the weight the forward applies, so the new model
computes the source's function at step 0:

- into a sigmaReparam layer from a plain weight ``W``: ``original = W`` and each part's
  ``gamma = sigma1`` with ``u, v`` its singular vectors (an exact SVD, as ``gamma_init=svd``),
  so ``W_hat = W`` whatever ``reparam.gamma_init`` says;
- from a sigmaReparam layer: ``W = gamma W_raw / (u^T W_raw v)`` per part with the checkpoint's
  own ``u, v``, what its forward computed;
- the same sigmaReparam tensors on both sides load as they are.

A tensor of this model that the source lacks, or holds in another shape (a classifier head for
another class count), keeps its initialisation and is named in a start note; a source of which
most tensors do not fit, or most of this model's are not there, is refused, as is one holding
non-finite values (a diverged run's) or an all-zero block that sigmaReparam would divide by zero.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from stabletrain.config import differs, shown_value
from stabletrain.errors import ConfigError
from stabletrain.models.registry import MODELS

_ORIGINAL = ".parametrizations.weight.original"
_PART = re.compile(r"^(.*)\.parametrizations\.weight\.0\.parts\.(\d+)\.(gamma|u|v)$")


# a folder of another code base: nanoGPT's out_dir, a Hugging Face model's (whole, or sharded with an index)
_FOREIGN_FILES = ("ckpt.pt", "model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                  "pytorch_model.bin.index.json")
_SHARD = re.compile(r"-\d+-of-(\d+)(?=\.(?:safetensors|bin)$)")  # model-00001-of-00003.safetensors


def _source_file(path: Path, key: str) -> Path:
    if path.is_dir():
        for f in (path / "checkpoints" / "last.pt", *(path / name for name in _FOREIGN_FILES)):
            if f.is_file():
                return f
        raise ConfigError(f"{key}{path}: a directory without checkpoints/last.pt, nanoGPT's ckpt.pt or a Hugging Face "
                          "model's weights (model.safetensors, pytorch_model.bin, or their .index.json); pass a run's "
                          "directory, a checkpoint it wrote, or a saved state dict")
    if not path.is_file():
        raise ConfigError(f"{key}{path}: no such file; pass a run's directory, a checkpoint it wrote "
                          "(checkpoints/last.pt), a saved state dict, nanoGPT's out_dir or a Hugging Face model folder")
    shard = _SHARD.search(path.name)
    if shard is None:
        return path
    index = path.parent / f"{_SHARD.sub('', path.name)}.index.json"  # one shard of several: all of them
    if index.is_file():
        return index
    if int(shard.group(1)) > 1:  # alone, it would load the part of the model it holds, the rest left at its init
        raise ConfigError(f"{key}{path}: one of {int(shard.group(1))} shards, without the {index.name} that names the "
                          "others; download the whole folder")
    return path


def _shards_of(pt: Path, step, key: str) -> Path:
    """The folder of ``pt``'s shards: ``<stem>_dcp/`` beside it, or for a ``last.pt`` whose save was
    cut off between its shards and itself, the previous shards (``.last_dcp.old``); the one saved at
    ``pt``'s step (the layout is engine.checkpoint's ``dcp_dir`` and engine.sharding's ``save_dcp``)."""
    import torch.distributed.checkpoint as dcp

    found = []
    for folder in (pt.parent / f"{pt.stem}_dcp", *([pt.parent / ".last_dcp.old"] if pt.name == "last.pt" else [])):
        if not (folder / ".metadata").is_file():
            continue
        saved = {"step": torch.tensor(-1)}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(saved, checkpoint_id=str(folder), no_dist=True)
        if int(saved["step"]) == step:
            return folder
        found.append(f"{folder.name}/ holds step {int(saved['step'])}")
    raise ConfigError(f"{key}{pt}: its sharded weights (step {step}) are not beside it "
                      f"({'; '.join(found) or f'no {pt.stem}_dcp/'}): a kill or another run replaced them; "
                      "pass one of its ring checkpoints (step_*.pt) instead")


def _read_sharded(pt: Path, step, key: str, which: str) -> dict[str, Tensor]:
    """The model (``which="model"``) or weight average (``"ema"``) of a sharded checkpoint, whole:
    only its tensors are read, not the optimizer's."""
    import torch.distributed.checkpoint as dcp

    folder = _shards_of(pt, step, key)
    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    model = {k[len(which) + 1:]: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in meta.items() if k.startswith(which + ".") and hasattr(m, "size")}
    if not model:
        raise ConfigError(f"{key}{pt}: {folder} holds no {'model' if which == 'model' else 'weight average'} tensors")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({which: model}, checkpoint_id=str(folder), no_dist=True)
    # GPT's lm_head is its wte: DCP saved the one tensor under both names, torch.save once
    if "lm_head.weight" in model and torch.equal(model["lm_head.weight"], model.get("wte.weight", torch.empty(0))):
        model["lm_head.weight"] = model["wte.weight"]
    return model


def _state_of(ck, pt: Path, key: str, average: bool):
    """The state dict inside a loaded checkpoint: the model's, or with ``average`` the weight average's."""
    # a run's, sharded or not, says why before its last_dcp/ is searched for tensors it cannot hold
    if average and isinstance(ck, dict) and "ema" in ck and ck["ema"] is None:
        raise ConfigError(f"{key}{pt}: holds no weight average (its run had ema.decay null); leave the average out")
    if isinstance(ck, dict) and ck.get("dcp"):
        return _read_sharded(pt, ck.get("step"), key, "ema" if average else "model")
    if not average:
        if isinstance(ck, dict) and isinstance(ck.get("model"), dict):  # stabletrain's
            return ck["model"]
        if isinstance(ck, dict) and isinstance(ck.get("state_dict"), dict):  # timm's training checkpoints
            return ck["state_dict"]
        return ck
    if isinstance(ck, dict) and isinstance(ck.get("ema"), dict) and isinstance(ck["ema"].get("module"), dict):
        return ck["ema"]["module"]
    if isinstance(ck, dict) and isinstance(ck.get("state_dict_ema"), dict):  # timm's
        return ck["state_dict_ema"]
    raise ConfigError(f"{key}{pt}: holds no weight average (one set of weights; a run with ema.decay set writes "
                      "both); leave the average out")


class Weights(NamedTuple):
    state: dict[str, Tensor]  # by name, the prefixes of compiled or DDP-wrapped models dropped
    path: Path  # the file they came from
    family: str | None  # the model family of the run that wrote it; None for a state dict
    averaged: bool  # whether that run also kept a weight average (ema)
    step: int | None  # the run's step at that checkpoint (nanoGPT's iter_num); None for a state dict
    settings: dict  # what the source says of its model, in its words: a run's model.* settings,
    #                 nanoGPT's model_args, the config.json of a Hugging Face model beside the file


_UNREAD = "pass a run's checkpoints/last.pt or a file of torch.save(model.state_dict())"


def _load(pt: Path, key: str, fix: str = _UNREAD):
    if pt.name.endswith(".index.json"):
        return _load_shards(pt, key)
    try:
        if pt.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(pt))
        return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:  # a torn write, a file that is no checkpoint
        raise ConfigError(f"{key}{pt}: not a readable checkpoint or state dict ({type(e).__name__}); {fix}") from None


def _load_shards(index: Path, key: str) -> dict[str, Tensor]:
    """The tensors of a Hugging Face model saved in shards: its index's ``weight_map`` names the
    file of each tensor."""
    import json

    try:
        said = json.loads(index.read_text())
    except (OSError, ValueError) as e:  # a download cut short
        raise ConfigError(f"{key}{index}: not a readable index of weight files ({type(e).__name__}); "
                          "download it again") from None
    files = said.get("weight_map") if isinstance(said, dict) else None
    files = dict.fromkeys(files.values()) if isinstance(files, dict) else None
    if not files or not all(isinstance(f, str) for f in files):
        raise ConfigError(f"{key}{index}: not an index of weight files (no weight_map); download it again")
    missing = [f for f in files if not (index.parent / f).is_file()]
    if missing:
        raise ConfigError(f"{key}{index}: {len(missing)} of the {len(files)} files its weight_map names are not in "
                          f"{index.parent} ({', '.join(missing[:3])}); download the whole folder")
    out = {}
    for f in files:
        shard = _load(index.parent / f, key, f"download it again (one of the files {index.name} names)")
        if not isinstance(shard, dict):
            raise ConfigError(f"{key}{index.parent / f}: holds no tensors by name; download the shard again")
        out |= shard
    return out


def read_weights(path: str | Path, average: bool = False, key: str = "init_weights=") -> Weights:
    """The model tensors of ``path`` (``average``: its weight average's instead), with where they
    came from. ``key`` begins the one-line errors (the setting or argument that named ``path``)."""
    pt = _source_file(Path(path), key)
    ck = _load(pt, key)
    state = _state_of(ck, pt, key, average)
    if not isinstance(state, dict) or not any(torch.is_tensor(v) for v in state.values()):
        raise ConfigError(f"{key}{pt}: holds no model tensors; pass a run's checkpoints/last.pt or a file of "
                          "torch.save(model.state_dict())")
    out = {}
    for k, v in state.items():
        if torch.is_tensor(v):
            while k.startswith(("_orig_mod.", "module.")):  # both, in either order: DDP of a compiled model
                k = k.split(".", 1)[1]                         # writes module._orig_mod.
            out[k] = v
    ck = ck if isinstance(ck, dict) else {}
    step = next((ck[k] for k in ("step", "iter_num") if isinstance(ck.get(k), int)), None)
    model = _run_model(ck)
    return Weights(out, pt, model.get("family"), ck.get("ema") is not None, step, model or _settings_of(ck, pt))


def _run_model(ck: dict) -> dict:
    """The ``model`` settings of the run that wrote checkpoint ``ck``; {} for another file."""
    import yaml

    try:
        model = yaml.safe_load(ck["config"])["model"]
    except Exception:  # a state dict, a checkpoint of another framework
        return {}
    return model if isinstance(model, dict) else {}


def _settings_of(ck: dict, pt: Path) -> dict:
    """What a checkpoint of another code base says of its model: nanoGPT's ``model_args``, or the
    ``config.json`` a Hugging Face model keeps beside its weights."""
    import json

    if isinstance(ck.get("model_args"), dict):
        return dict(ck["model_args"])
    try:
        said = json.loads((pt.parent / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return said if isinstance(said, dict) else {}


def non_finite(state: dict[str, Tensor]) -> list[str]:
    """The names of ``state``'s tensors holding a NaN or an inf (a diverged run's weights)."""
    return [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def folded(src: dict[str, Tensor]) -> tuple[dict[str, Tensor], int]:
    """``src`` with each sigmaReparam layer's tensors replaced by the one weight its forward
    applied (``layer.weight``): a plain state dict, as a model without sigmaReparam holds it
    (timm's ViT and Swin of the same shape load it); and how many layers were folded."""
    layers = [k[:-len(_ORIGINAL)] for k in src if k.endswith(_ORIGINAL)]
    out = {k: v for k, v in src.items() if not any(k.startswith(f"{layer}.parametrizations.") for layer in layers)}
    for layer in layers:
        out[f"{layer}.weight"] = _applied(src, layer)
    return out, len(layers)


def _weight_keys(state: dict, layer: str) -> set[str]:
    return {k for k in state if k == f"{layer}.weight" or k.startswith(layer + ".parametrizations.weight.")}


def _applied(src: dict[str, Tensor], layer: str) -> Tensor | None:
    """The weight ``layer``'s forward applied in the source: its plain weight, or its sigmaReparam
    weight scaled part by part (parts cover the rows from the first on; raw rows come last)."""
    if f"{layer}.weight" in src:
        return src[f"{layer}.weight"]
    raw = src.get(layer + _ORIGINAL)
    if raw is None:
        return None
    parts = sorted({int(m.group(2)) for k in src if (m := _PART.match(k)) and m.group(1) == layer})
    m = raw.double().reshape(raw.shape[0], -1)
    out, lo = [], 0
    for i in parts:
        pre = f"{layer}.parametrizations.weight.0.parts.{i}."
        u, v, gamma = src[pre + "u"].double(), src[pre + "v"].double(), src[pre + "gamma"].double()
        block = m[lo:lo + len(u)]
        out.append(block * (gamma / (u @ block @ v)))
        lo += len(u)
    out.append(m[lo:])
    return torch.cat(out).reshape(raw.shape).to(raw.dtype)


def _as_reparam(mod: nn.Module, layer: str, w: Tensor) -> dict[str, Tensor]:
    """The sigmaReparam tensors of ``mod`` that apply ``w`` itself: ``original = w``, and per part
    ``gamma = sigma1`` with ``u, v`` the top singular vectors of its rows."""
    rep = mod.parametrizations.weight[0]
    out = {layer + _ORIGINAL: w}
    m = w.double().reshape(w.shape[0], -1)
    for i, (lo, hi) in enumerate((lo, hi) for lo, hi, p in rep.ranges if p is not None):
        u, s, vh = torch.linalg.svd(m[lo:hi], full_matrices=False)
        if s[0] == 0:  # gamma / sigma = 0 / 0: refused as apply_reparam refuses an all-zero weight
            raise ConfigError(f"init_weights: rows {lo}:{hi} of the loaded {layer}.weight are all zero, which "
                              "sigmaReparam cannot scale (gamma / sigma = 0 / 0); start from them with reparam=none")
        pre = f"{layer}.parametrizations.weight.0.parts.{i}."
        out |= {pre + "gamma": s[:1], pre + "u": u[:, 0], pre + "v": vh[0]}
    return out


def load_weights(model: nn.Module, path: str | Path, model_cfg=None) -> str:
    """Load ``path``'s weights into ``model`` (built from ``model_cfg``, the ``model`` group: its
    family is checked against a run checkpoint's and reads another code base's checkpoint) in place
    (see the module's docstring); returns the start note that says what came from where and what
    kept its initialisation."""
    src, pt, there, averaged, _, settings = read_weights(path)
    family = model_cfg.family if model_cfg is not None else None
    if family is not None and there is not None and there != family:
        raise ConfigError(f"init_weights={pt}: a {there} run's weights, this run's model is a {family}; start from a "
                          f"{family} run")
    read_as: list[str] = []  # how the family read them, for the note
    adapt = MODELS.entry(family).info.get("weights") if family in MODELS else None
    if adapt is not None:  # the family's reading of its kin: another code base's names, a longer context
        try:
            src, settings, read_as = adapt(src, settings, model_cfg, model)
        except ConfigError as e:
            raise ConfigError(f"init_weights={pt}: {e}") from None
    # a diverged run's weights would only be stepped over as non-finite (and an SVD of them fails)
    bad = non_finite(src)
    if bad:
        raise ConfigError(f"init_weights={pt}: {len(bad)} of its {len(src)} tensors hold non-finite values ("
                          + ", ".join(bad[:4]) + (" ..." if len(bad) > 4 else "") + "); start from weights "
                          "before the run diverged")
    mine = model.state_dict()
    take = {k: v for k, v in src.items() if k in mine and v.shape == mine[k].shape}
    used = set()
    mapped = 0
    for layer, mod in model.named_modules():
        keys, theirs = _weight_keys(mine, layer), _weight_keys(src, layer)
        # the same names in both load as they are; else another sigmaReparam layout (a v slice scaled
        # there, raw here, under names alike) or none on one side: through the weight applied, or not at all
        if not layer or not keys or keys == theirs and keys <= set(take):
            continue
        for k in keys:
            take.pop(k, None)
        has_rep = parametrize.is_parametrized(mod, "weight")
        w = _applied(src, layer)
        if w is None or w.shape != (mod.parametrizations.weight.original if has_rep else mod.weight).shape:
            continue
        take |= _as_reparam(mod, layer, w) if has_rep else {f"{layer}.weight": w}
        used |= theirs
        mapped += 1
    kept = [k for k in mine if k not in take]
    used |= {k for k in take if k in src}
    unused = [k for k in src if k not in used]
    differ = _settings_differ(settings, model_cfg)  # the source's own words for why its shapes differ
    shaped = ", ".join(said for k, said in differ.items() if k not in SHAPELESS)
    if 2 * len(kept) > len(mine) or 2 * len(unused) > len(src):  # a head may differ (a fine-tune), not most
        said = _shape_said(kept[0], mine, src) if kept else f"{unused[0]} (not here)"
        fix = (f"set what the source's model had: {', '.join(differ.values())}" if differ
               else "start from a run of the same model")
        raise ConfigError(f"init_weights={pt}: {len(used)} of its {len(src)} tensors fit this model's {len(mine)} "
                          f"(names or shapes differ: {said}); {fix}")
    with torch.no_grad():
        model.load_state_dict({k: take.get(k, v).to(v.dtype) for k, v in mine.items()})
    note = f"init_weights: {len(mine) - len(kept)} of the model's {len(mine)} tensors from {pt}"
    note += f" ({'; '.join(read_as)})" if read_as else ""
    if mapped:
        note += f" ({mapped} layer(s) through the weight applied, across sigmaReparam)"
    if kept:
        shown = ", ".join(_shape_said(k, mine, src) for k in kept[:4])
        note += f"; {len(kept)} kept their initialisation: {shown}" + (" ..." if len(kept) > 4 else "")
        note += f" (the source's model had {shaped})" if shaped else ""  # a resampled size is not said: it fits
    if unused:
        note += f"; {len(unused)} of the source's unused: {', '.join(unused[:4])}" + (" ..." if len(unused) > 4 else "")
    if same_shapes := ", ".join(said for k, said in differ.items() if k in SHAPELESS):  # another function
        note += f"; the source's model had {same_shapes}: the weights load, the function they compute here is another"
    if averaged:  # its val_ema/* scored another set of weights than the ones that come over
        note += ("; its weight average (ema) is not loaded, its live weights are (scripts/export_weights.py "
                 "--ema writes the average as a file to start from)")
    return note + "; the optimizer, schedule and step count start afresh"


_RESAMPLED = ("img_size", "patch_size", "window_size", "in_chans")  # the sizes timm_filter fits


def timm_filter(filter_fn, trunk: str = ""):
    """A family's ``weights`` hook made of timm's own checkpoint filter (its ``checkpoint_filter_fn``,
    what timm applies to pretrained weights): a source of another image or patch size, or another
    window, has its position embedding, patch embedding or relative position tables resampled as
    timm resamples them (bicubic), older layouts renamed; a patch embedding of another channel count
    (RGB weights, grey digits) is summed or repeated as timm's pretrained loading adapts it (the same
    function of a grey image). The note names each tensor resampled; one resampled into a shape this
    model does not hold (a class token on one side only) is left as the source holds it. ``trunk``: the
    prefix the filter drops, of a trunk inside a larger model (OpenCLIP's ``visual.trunk.``); a tensor
    resampled is named with its name there too, and where the filter fails, the trunk loads as it is."""
    def hook(state: dict[str, Tensor], settings: dict, model_cfg, model: nn.Module):
        mine = model.state_dict()
        proj = "patch_embed.proj"
        here = mine.get(f"{proj}.weight", mine.get(proj + _ORIGINAL))
        if proj + _ORIGINAL in state and here is not None and state[proj + _ORIGINAL].shape != here.shape:
            # a sigmaReparam run's: timm resamples the weight its forward applied, under the plain name
            state = {k: v for k, v in state.items() if not k.startswith(f"{proj}.parametrizations.")
                     } | {f"{proj}.weight": _applied(state, proj)}
        prefix = trunk if trunk and any(k.startswith(trunk) for k in state) else ""
        said_by_timm = logging.getLogger("timm.layers")  # "Resized position embedding": the note says it
        level = said_by_timm.level
        said_by_timm.setLevel(logging.WARNING)
        try:
            with warnings.catch_warnings():  # timm's table resize warns of its own indexing, not the user's
                warnings.filterwarnings("ignore", category=UserWarning, module="timm.layers.interpolate")
                out = filter_fn(state, model)
        except Exception:  # a layout the filter cannot resample (a class token on one side only): the
            # trunk loaded as it is, the tensors that do not fit named
            out = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        finally:
            said_by_timm.setLevel(level)
        w = out.get(f"{proj}.weight")
        if w is not None and here is not None and w.dim() == 4 and w.shape[1] != here.shape[1]:
            out[f"{proj}.weight"] = _channels_adapted(w, here.shape[1])
        said, passed = [], {id(v) for v in state.values()}  # what the filter passed on, renamed or not
        name_there = {id(v): k for k, v in state.items()}
        for k, v in list(out.items()):  # one the filter renamed or made that does not fit: the source's as it is
            if k in state or prefix + k in state or (k in mine and v.shape == mine[k].shape):
                continue
            del out[k]  # a tensor it made (OpenCLIP's projection's zero bias) was never the source's
            if id(v) in passed:  # renamed (OpenCLIP's visual.head.proj.weight as head.weight): its own name
                out[name_there[id(v)]] = v
        for k, v in out.items():  # (an older layout's tensor renamed onto another's name is no resample)
            was = k if k in state else prefix + k if prefix + k in state else None  # visual.trunk.pos_embed
            if id(v) not in passed and was is not None and v.shape != state[was].shape:
                held = mine.get(k, mine.get(k.removesuffix(".weight") + _ORIGINAL))
                if held is None or v.shape != held.shape:  # not resampled to this model: named as it is
                    out[k] = state[was]
                else:
                    there = f" ({was} there)" if was != k else ""
                    said.append(f"{k}{there} resampled from {tuple(state[was].shape)} to {tuple(v.shape)} as timm does")
        if said:  # the sizes the resample fitted: no longer the source's settings to name
            settings = {**settings, **{k: model_cfg[k] for k in _RESAMPLED if k in settings}}
        return out, settings, said

    return hook


def _channels_adapted(w: Tensor, chans: int) -> Tensor:
    """A patch embedding ``(out, in, kh, kw)`` for ``chans`` input channels, computing on a grey image
    (each channel alike) what ``w`` computed: summed into one channel, or one spread over ``chans``
    (timm's adapt_input_conv, whose signature differs across the timm versions allowed). Other counts
    keep ``w``, which then does not fit and is named."""
    if chans == 1:
        return w.sum(1, keepdim=True)
    return w.repeat(1, chans, 1, 1) / chans if w.shape[1] == 1 else w


# model.* settings that change what the same tensors compute: the others change shapes, which the
# note names tensor by tensor (kept, resampled, cut), with the source's settings where tensors are kept
SHAPELESS = ("num_heads", "stage_heads", "act")


def _settings_differ(theirs: dict, model_cfg) -> dict[str, str]:
    """The source's model settings that this model's differ from, by key, each said as
    ``model.key=theirs (this run: ours)``; only keys its family reads, dropout aside (it trains, it
    does not change the function)."""
    if model_cfg is None or model_cfg.family not in MODELS:
        return {}
    keys = [k for k in MODELS.entry(model_cfg.family).info.get("keys", ()) if k not in ("dropout", "drop_path")]
    return {k: f"model.{k}={shown_value(theirs[k])} (this run: {shown_value(model_cfg[k])})" for k in keys
            if k in theirs and differs(model_cfg[k], theirs[k])}


def _shape_said(key: str, mine: dict, src: dict) -> str:
    if key in src:
        return f"{key} ({tuple(mine[key].shape)} here, {tuple(src[key].shape)} there)"
    return f"{key} (not there)"
