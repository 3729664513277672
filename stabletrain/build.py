"""The one place a config becomes objects: data, model, optimizer, schedule, loss terms, step
hooks, EMA, monitor and metrics sink, handed to the :class:`~stabletrain.engine.loop.Trainer`.

Every option is looked up in its group's registry, so nothing here dispatches on a name:

==============  =========================================  ==========================
config key      registry                                   module
==============  =========================================  ==========================
model.family    ``MODELS``                                 stabletrain.models.*
norm            ``NORMS``                                  stabletrain.layers.norm
attention       ``ATTENTIONS``                             stabletrain.layers.attention
init            ``INITS``                                  stabletrain.layers.init
reparam         ``REPARAMS``                               stabletrain.layers.reparam
deescalate.name ``DEESCALATIONS``                          stabletrain.layers.deescalate
optim           ``OPTIMIZERS``                             stabletrain.optim
schedule        ``SCHEDULES``                              stabletrain.optim.schedule
data            ``DATASETS``                               stabletrain.data
regularizer     ``LOSS_TERMS``                             stabletrain.losses.*
==============  =========================================  ==========================
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import inspect
import math
from collections.abc import Collection, Container
from pathlib import Path

import torch
from omegaconf import OmegaConf, open_dict
from torch import nn
from torch.nn.utils import parametrize

from stabletrain import config as C
from stabletrain.config import Components
from stabletrain.data import DATASETS, OPTION_KEYS, Data, Shard, resolve_name, task_loss
from stabletrain.engine import distributed as D
from stabletrain.engine.checkpoint import last_checkpoint, seed_all
from stabletrain.engine.divergence import DivergenceWatch
from stabletrain.engine.loop import EVAL_BATCH_CAP, LoopSettings, Trainer, autocast_for
from stabletrain.engine.memory import check_host_memory
from stabletrain.engine.rundir import task_overrides
from stabletrain.errors import ConfigError
from stabletrain.layers.attention import ATTENTIONS
from stabletrain.layers.deescalate import DEESCALATIONS, Deescalate
from stabletrain.layers.init import INITS
from stabletrain.layers.locater import attention_layers
from stabletrain.layers.norm import NORMS
from stabletrain.layers.reparam import REPARAMS
from stabletrain.losses import LOSS_TERMS, build_loss_terms
from stabletrain.metrics import Metrics, StartNote
from stabletrain.models.registry import (KINDS, MODELS, build_model_and_hook, family_entry, is_builtin,
                                         transformer_blocks, unread_model_keys)
from stabletrain.optim import OPTIMIZERS, OptimizerSchedule, build_optimizer, make_schedule, scaled_lr
from stabletrain.optim.schedule import SCHEDULES
from stabletrain.registry import import_modules, option_value


class Everything:
    """``swept`` of a sweep point at run time: the sweep was checked, point by point, before launch."""

    def __contains__(self, _group: str) -> bool:
        return True


def validate(cfg, swept: Container[str] = ()) -> None:
    """Every check that runs before any work: the config's ranges, each option against its
    registry, what the model family and the data set allow, the loss terms' parameters.
    Raises :class:`ConfigError` with one line. ``swept``: the groups whose option the sweep of
    this point varies; settings for their other options (``data.path`` of data=tokens,
    ``norm.kwargs`` of one's own norm) are noted at this point, not refused."""
    import_modules(cfg.imports)
    C.validate(cfg)
    family = family_entry(cfg.model.family)
    if cfg.model.kwargs and is_builtin(family) and "model" not in swept:
        raise ConfigError(f"model.kwargs is for a model family of your own (imports=...); model.family={family.name} "
                          f"takes its arguments as model.* keys (`python train.py --cfg job` lists them)")
    check_own_kwargs("model", family, cfg.model.kwargs)
    if not is_builtin(family):
        MODELS.check_callable(family.name)
    for group, (registry, name) in _chosen_options(cfg).items():
        entry = registry.entry(name)
        if not is_builtin(entry):
            registry.check_callable(name)
        if cfg[group].get("kwargs") and is_builtin(entry) and group not in swept:
            raise ConfigError(f"{group}.kwargs is for a {group} option of your own (imports=...); {group}={entry.name} "
                              f"takes its settings as {group}.* keys (`python train.py --cfg job` lists them)")
        check_own_kwargs(group, entry, cfg[group].get("kwargs"))
    if family.info.get("check"):
        family.info["check"](cfg.model, Components.of(cfg))
        if cfg.data.img_size is not None and family.info["kind"] == "vision":
            _check_data_img_size(cfg, family.info["check"])
    data = _data_entry(cfg)
    if not is_builtin(data):
        DATASETS.check_callable(data.name)
    if data.info["kind"] == "text":
        d = cfg.data
        extra = [k for k in IMAGE_AUGMENTATION if (bool(d[k]) if k == "randaug" else d[k] > 0)]
        if extra:
            raise ConfigError(f"data.{extra[0]} is image augmentation; a {family.name} model trains on text: "
                              f"remove data.{extra[0]}")
        # the image classifier's settings, which a text run would ignore: refused, but in a sweep
        # over model families noted at its text points (its image points read them)
        for key, what in IMAGE_ONLY.items():
            if C.differs(d[key], C.schema_default(f"data.{key}")) and not {"model", "data"} & set(swept):
                raise ConfigError(f"data.{key}={C.shown_value(d[key])} sets {what}; a {family.name} model trains "
                                  f"on text: remove data.{key}")
    else:
        from stabletrain.data.vision import check_randaug

        check_randaug(cfg.data.randaug)
    unread = _unread_data_keys(cfg)
    # the user's files, which this run would not train on
    if (files := [k for k in unread if k in ("path", "root")]) and "data" not in swept:
        key = files[0]
        readers = [e.name for e in DATASETS.entries() if key in (e.info.get("reads") or ())]
        picked = f"data=auto picks {data.name} for a {family.name} model" if option_value(cfg.data.name) == "auto" \
            else f"this run has data={data.name}"
        raise ConfigError(f"data.{key}={cfg.data[key]} is read by data={'/'.join(readers)} only, and {picked}: "
                          + (f"add data={readers[0]}" if len(readers) == 1 else "add the one it belongs to"))
    if data.info.get("check"):
        data.info["check"](cfg.data)
    for name, given in (cfg.regularizer or {}).items():
        if name == "name" or not (given is None or hasattr(given, "items")):
            # a yaml written as the other groups' (name: mine, coef: ...): this group maps terms to parameters
            raise ConfigError(f"regularizer.{name}={given} is no loss term's parameters: a loss term's yaml holds "
                              f"them under the term's name, as configs/regularizer/zloss.yaml does "
                              f"(zloss: {{coef: 1.0e-4}}), not as name: and keys of their own")
        LOSS_TERMS.entry(name)
    build_loss_terms(cfg.regularizer)
    check_parallel(cfg)


def _check_data_img_size(cfg, check) -> None:
    """The family's check of the size the images are resized to (``data.img_size``, which the
    model is then built at), its message naming the key the user gave."""
    sized = copy.deepcopy(cfg.model)
    with open_dict(sized) if OmegaConf.is_config(sized) else contextlib.nullcontext():
        sized.img_size = cfg.data.img_size
    try:
        check(sized, Components.of(cfg))
    except ConfigError as e:
        said = str(e).replace(f"model.img_size={cfg.data.img_size}", f"data.img_size={cfg.data.img_size}")
        raise ConfigError(said) from None


def declared_kwargs(group: str, entry) -> tuple[str, ...] | None:
    """The ``<group>.kwargs`` names an option of one's own takes: declared at registration
    (``kwargs=("g0",)``), or for an init, whose kwargs arrive as keyword arguments, read from its
    signature; None when unknown (the option reads what it likes)."""
    if entry.info.get("kwargs") is not None:
        return tuple(entry.info["kwargs"])
    if group == "init":
        params = list(inspect.signature(entry.fn).parameters.values())[2:]  # after (weight, gain)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return None


def check_own_kwargs(group: str, entry, given) -> None:
    """A ``<group>.kwargs`` key the option does not take is refused before anything is built: a
    misspelt one would otherwise be silently unread."""
    names = declared_kwargs(group, entry)
    unknown = [k for k in (given or {}) if names is not None and k not in names]
    if unknown:
        near = difflib.get_close_matches(unknown[0], names, n=1, cutoff=0.6)
        raise ConfigError(f"{group}.kwargs.{unknown[0]}: {entry.name} takes no such argument (it takes: "
                          f"{', '.join(names) or 'none'})"
                          + (f"; did you mean {group}.kwargs.{near[0]}?" if near else ""))


def _chosen_options(cfg) -> dict:
    """Each component group -> ``(its registry, the option chosen)``."""
    return {"norm": (NORMS, cfg.norm.name), "attention": (ATTENTIONS, cfg.attention.name),
            "init": (INITS, cfg.init.name), "reparam": (REPARAMS, cfg.reparam.name),
            "optim": (OPTIMIZERS, cfg.optim.name), "schedule": (SCHEDULES, cfg.schedule.name),
            "deescalate": (DEESCALATIONS, cfg.deescalate.name)}


def unread_kwargs_notes(cfg) -> list[str]:
    """A note for each ``<group>.kwargs`` given to a stabletrain option, which reads none (in a
    sweep over the group's options: :func:`validate` refuses them elsewhere)."""
    chosen = {"model": (family_entry(cfg.model.family), "model.family"),
              **{g: (r.entry(n), g) for g, (r, n) in _chosen_options(cfg).items()}}
    return [f"note: {group}.kwargs.{k}={C.shown_value(v)} changes nothing: {key}={entry.name} is stabletrain's own "
            f"and reads no {group}.kwargs (they are for an option of your own)"
            for group, (entry, key) in chosen.items() if is_builtin(entry)
            for k, v in (cfg[group].get("kwargs") or {}).items()]


def short_bound_note(optim_cfg, total_steps: int) -> str | None:
    """Said where AdamW²'s bound leaves a weight matrix little room to grow in the run: each
    update's spectral norm is at most tau x sigma1(W), so sigma1 grows by at most (1 + tau)^steps,
    and a short run from a small init may stay near chance (vit_test, 100 steps: 1.5x, val/acc
    0.07 against AdamW's 0.31), though not every one does (conv_vit_mini reached 0.93). Said below
    10x: a byte-level gpt_mini of 150 steps at tau 0.01 (4.5x) reached val/loss 4.2 where AdamW
    reached 3.5 in 80; conv_vit_mini with the default run's recipe (600 steps at 0.004: 11x) trains well."""
    if option_value(optim_cfg.name) != "adamw2" or optim_cfg.tau is None:
        return None
    # in logs: (1 + tau)^steps overflows a float for a paper-length run (GPT-S: 1.01^600000)
    if total_steps * math.log1p(optim_cfg.tau) >= math.log(10):
        return None
    growth = (1 + optim_cfg.tau) ** total_steps
    return (f"note: optim=adamw2 bounds each update to tau={optim_cfg.tau:g} x sigma1(W), so in these {total_steps} "
            f"steps a weight matrix's sigma1 can grow {growth:.3g}x at most: where the loss falls slowly, that is the "
            f"likely limit (more steps, a larger optim.tau, or optim=adamw)")


def batch_over_data_note(data: Data, batch_size: int) -> str | None:
    """Said where one batch holds more than the training set: every step repeats it."""
    per = batch_size * (data.seq_len if data.kind == "text" else 1)
    if per <= data.n_train:
        return None
    what = "tokens" if data.kind == "text" else "samples"
    return (f"note: a batch ({per} {what}) holds {per / data.n_train:.3g}x the {data.n_train} training {what}: "
            f"each step sees them repeated (a smaller batch_size, or more data)")


def augment_line(cfg, data: Data) -> str | None:
    """The start line of an image run's augmentation and regularisation, in timm's terms, where
    any is on: what a timm user checks in its log before the first step."""
    d, parts = cfg.data, []
    if data.kind != "vision":
        return None
    unread = set(_unread_data_keys(cfg))  # the digits take no image transforms (a note says so)
    if d.randaug and "randaug" not in unread:
        parts.append(f"RandAugment {d.randaug}")
    if d.erasing > 0 and "erasing" not in unread:
        parts.append(f"random erasing p={d.erasing:g}")
    if d.repeated_aug > 1:
        parts.append(f"each sample {d.repeated_aug}x per batch (repeated augmentation)")
    smoothing = f", label smoothing {d.label_smoothing:g}" if d.label_smoothing > 0 else ""
    if d.mixup > 0 or d.cutmix > 0:
        parts.append(f"mixup alpha {d.mixup:g} / cutmix alpha {d.cutmix:g} (soft-target cross-entropy{smoothing})")
    elif smoothing:
        parts.append(f"cross-entropy{smoothing}")
    if cfg.model.get("drop_path", 0) > 0:
        parts.append(f"drop path {cfg.model.drop_path:g}")
    return f"augmentation: {'; '.join(parts)}" if parts else None


def cadence_note(monitor_cfg, total_steps: int, passes: Collection[str] = ("weight", "entropy"), adamw2: bool = False,
                 start: int = 0) -> str | None:
    """Said where a monitor pass runs fewer than three times after step 0: the weight pass, whose
    curves (sigma1, SEC) are then two or three points, or the probe pass, which measures attention
    entropy and raises its alerts: a collapse early in a short run is then seen at its end. AdamW²'s
    per-tensor rates (adamw2_lr.png), logged with or without the monitors, likewise. ``start``: the
    step a resumed run starts from; the passes before it ran in the earlier process. ``passes``:
    what the monitors read of this model (MonitorRunner.reads; none without monitors)."""
    if start >= total_steps:  # resumed at its last step: no pass is still to come
        return None
    alerts = " and its alerts" if monitor_cfg.alerts else ""
    probe = f"attention entropy{alerts}" if "entropy" in passes else "the output's log Z"
    logged = ([("the weight pass (sigma1, SEC, the QK spectrum)", "runs", "weight_every", True)] * ("weight" in passes)
              + [(f"the probe pass ({probe})", "runs", "probe_every", True)] * bool(passes)
              + [("AdamW²'s per-tensor rates (adamw2_lr.png)", "are logged", "adamw2_every", False)] * adamw2)
    sparse = [(what, verb, key, getattr(monitor_cfg, key), at_start) for what, verb, key, at_start in logged
              if total_steps < 3 * getattr(monitor_cfg, key)]
    if not sparse:
        return None

    def at(every: int, at_start: bool) -> str:  # the probe and weight passes also run before step 1
        steps = [0] * at_start + [*range(every, total_steps + 1, every)]
        steps = [s for s in steps + ([total_steps] if total_steps % every else []) if s > start or s == start == 0]
        if len(steps) == 1:
            return f"step {steps[0]} only"
        return f"steps {', '.join(map(str, steps[:-1]))} and {steps[-1]}"

    runs = " and ".join(f"{what}{' ' + verb if i == 0 else ''} at {at(every, at_start)} (monitor.{key}={every})"
                        for i, (what, verb, key, every, at_start) in enumerate(sparse))
    fix = " ".join(f"monitor.{key}={max(1, total_steps // 10)}" for _, _, key, _, _ in sparse)
    since = f", from step {start}," if start else ""
    often = "ten times" if total_steps >= 10 else "at every step"  # a 3-step run cannot watch ten times
    return (f"note: in this {total_steps}-step run{since} {runs}; {fix} "
            + (f"watches it {often}" if len(sparse) == 1 else f"watch each {often}"))


def ema_note(ema_cfg, total_steps: int) -> str:
    """The start line of the weight average: its horizon, and a warning where it outlasts the run
    (``val_ema/*`` would then score mostly the initial weights)."""
    horizon = 1.0 / (1.0 - ema_cfg.decay)  # steps; averaging every k-th step with decay**k keeps it
    line = f"weight average: ema.decay={ema_cfg.decay:g} (over ~{horizon:.0f} steps), scored as val_ema/*"
    if ema_cfg.every > total_steps:
        line = (f"warning: ema.every={ema_cfg.every} is more than the run's {total_steps} steps: the average never "
                f"takes a step, and val_ema/* scores the initial weights; lower ema.every")
    elif horizon > total_steps and not ema_cfg.warmup:
        line = (f"warning: ema.decay={ema_cfg.decay:g} averages over ~{horizon:.0f} steps, more than the run's "
                f"{total_steps}: val_ema/* will mostly score the initial weights (lower it, or set ema.warmup=true)")
    return line


def eval_note(data, cfg) -> str | None:
    """Said where an evaluation scores only part of a vision val set: an accuracy to compare with a
    paper's is over all of it. (Text is scored on random windows, as nanoGPT does: an estimate.)"""
    bs = min(cfg.batch_size, EVAL_BATCH_CAP)
    scored = cfg.eval_batches * bs
    if data.kind != "vision" or not data.n_val or scored >= data.n_val:
        return None
    return (f"validation: {scored} of the {data.n_val} val images per evaluation (eval_batches={cfg.eval_batches} "
            f"of {bs}, a fixed random part); eval_batches={math.ceil(data.n_val / bs)} scores them all")


def preset(cfg, group: str) -> str:
    """The option of ``group`` as a user types it, where two presets register one name: sigma_qk
    is sigma on q/k, block and ffn are where the one de-escalation goes."""
    g, name = cfg[group], option_value(cfg[group].name)
    if group == "reparam" and name == "sigma" and option_value(g.get("apply_to")) == "qk":
        return "sigma_qk"
    if group == "deescalate" and name == "deescalate":
        return option_value(g.placement)
    return name


def components_line(cfg) -> str:
    """What the blocks are built of and what the loss adds: the start line that says an override
    of ``norm``, ``attention``, ... took (with the arguments of an option of one's own)."""
    def chosen(group: str) -> str:
        g, name = cfg[group], option_value(cfg[group].name)
        registry = _chosen_options(cfg)[group][0]
        # a stabletrain option reads no kwargs (a sweep's, for its own option: noted apart)
        details = [] if is_builtin(registry.entry(name)) else [f"{k}={v}" for k, v in (g.get("kwargs") or {}).items()]
        name = preset(cfg, group)
        if group == "norm":
            details = ([f"alpha={g.alpha:g}"] if name == "stablenorm" else []) + details
            details += ["post-norm"] if option_value(g.placement) == "post" else []
        return f"{group}={name}" + (f" ({', '.join(details)})" if details else "")

    def term(name, params) -> str:
        shown = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={C.shown_value(v)}" for k, v in (params or {}).items()]
        return f"{name} ({', '.join(shown)})" if shown else name

    terms = ", ".join(term(t, p) for t, p in (cfg.regularizer or {}).items()) or "none"
    return "components: " + ", ".join(chosen(g) for g in ("norm", "attention", "init", "reparam", "deescalate")) \
        + f"; loss terms: {terms}"


def stablenorm_note(cfg) -> str | None:
    """Said where StableNorm with alpha < 0.5 meets AdamW²: a combination that can learn slowly
    (docs/methods.md §5: alone on the digits ViT 0.721 against 0.911; with StableInit and
    StableAtten 0.950 there, but slower on the GPT), which a user trying one override would take
    for StableNorm's fault."""
    alpha, width = cfg.norm.alpha, cfg.model.embed_dim
    if option_value(cfg.norm.name) != "stablenorm" or option_value(cfg.optim.name) != "adamw2" or alpha >= 0.5:
        return None
    return (f"note: norm=stablenorm with norm.alpha={alpha:g} under optim=adamw2 can learn slowly: a StableNorm's "
            f"output is d^(alpha-0.5) = {width ** (alpha - 0.5):.2f}x an RMSNorm's at width {width}, and AdamW² "
            f"bounds how fast the weights grow to make up for it (optim.tau); the paper's Stable-Transformer "
            f"recipes train with optim=adamw (docs/methods.md §5)")


def own_groups(cfg) -> dict[str, tuple[str, ...] | None]:
    """The component groups whose chosen option the user registered (``imports``), each with the
    keys of its group the option declared it reads (``register(keys=...)``; None: any)."""
    out = {}
    for group, (reg, name) in _chosen_options(cfg).items():
        entry = reg.entry(name)
        if not is_builtin(entry):
            keys = entry.info.get("keys")
            out[group] = None if keys is None else tuple(keys)
    return out


def check_parallel(cfg, world: int | None = None) -> None:
    """``parallel=fsdp``: a distributed launch. What it does not support would be refused here, in one
    line (docs/distributed.md "FSDP2")."""
    if cfg.parallel != "fsdp":
        return
    if world is None:
        from stabletrain.topology import detect

        world = detect().world
    if world < 2:
        raise ConfigError("parallel=fsdp shards over the ranks of a distributed launch (torchrun / srun with "
                          "2+ processes); a single process trains with parallel=ddp (a run written with "
                          "parallel=fsdp resumes only under such a launch, of any number of processes)")


def check_compiler(device: torch.device) -> None:
    """``compile=true``: what inductor builds its kernels with is there (a C++ compiler for the
    CPU, triton for CUDA), or one line now instead of a traceback at the first step."""
    import importlib.util
    import shutil

    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError("compile=true on CUDA needs triton (torch.compile's GPU kernels): pip install triton, "
                          "or set compile=false")
    if device.type == "cpu":
        import torch._inductor.config as inductor

        names = [c for c in inductor.cpp.cxx if c]
        if not any(shutil.which(c) for c in names):
            raise ConfigError(f"compile=true on a CPU builds C++ kernels, but no C++ compiler was found "
                              f"(looked for {', '.join(names)}; $CXX chooses another): install one, "
                              f"or set compile=false")


def resolve_compile(asked: bool | None, device: torch.device) -> bool:
    """``compile``: as asked (checked by :func:`check_compiler`); unset, on for a CUDA GPU with
    triton, as nanoGPT compiles by default, and off on a CPU, where inductor's C++ build of
    every kernel takes longer than a short run saves."""
    if asked is None:
        if device.type != "cuda":
            return False
        try:
            check_compiler(device)
        except ConfigError:
            return False
        return True
    if asked:
        check_compiler(device)
    return asked


def _data_entry(cfg):
    """The registry entry of ``cfg``'s data set, refused when it does not fit the model family."""
    family = family_entry(cfg.model.family)
    data = DATASETS.entry(resolve_name(cfg.data, family.info.get("data") or KINDS[family.info["kind"]]))
    if data.info["kind"] != family.info["kind"]:
        fits = ", ".join(e.name for e in DATASETS.entries() if e.info["kind"] == family.info["kind"])
        raise ConfigError(f"data={data.name} does not fit model={cfg.model.name} (a {family.name} model); "
                          f"use data=auto or one of: {fits}")
    return data


def _equivalent_values(cfg) -> dict:
    """Values that configure the same run, so that a resume does not take one for the other as a
    change: ``data=auto`` and the data set it picks for this model family."""
    family = family_entry(cfg.model.family)
    default = family.info.get("data") or KINDS[family.info["kind"]]
    return {"data.name": ("auto", default)} if _data_entry(cfg).name == default else {}


def data_from_config(cfg) -> Data:
    """The data set of ``cfg``, as the trainer gets it, its ``source`` the option and its files."""
    entry = _data_entry(cfg)
    data = DATASETS.make(entry.name, cfg.data, cfg.model, cfg.seed)
    files = next((cfg.data[k] for k in ("path", "root") if k in (entry.info.get("reads") or ())), None)
    auto = " (data=auto)" if option_value(cfg.data.name) == "auto" else ""
    data.source = f"{entry.name}{auto}" + (f" at {files}" if files else "") + (
        f", {cfg.data.tokenizer} tokens" if "tokenizer" in (entry.info.get("reads") or ()) else "")
    if data.extra.get("val_classes"):
        data.source += f" ({data.extra['val_classes']})"
    if data.kind == "vision" and files:  # image files of any size: which size they are trained at
        size = cfg.model.img_size if cfg.data.img_size is None else cfg.data.img_size
        data.source += f", images resized to {size} px" + (" (model.img_size; data.img_size sets another)"
                                                            if cfg.data.img_size is None else "")
    return data


def _unread_data_keys(cfg, given: Collection[str] = ()) -> list[str]:
    """The data keys (``path``, ``erasing``, ...) the chosen data set does not read that are set
    away from their defaults or ``given`` on the command line; an option's own yaml sets only what
    it reads."""
    return [key.split(".", 1)[1] for key in unread_data_reasons(cfg)
            if key in given or C.differs(cfg.data[key.split(".", 1)[1]], C.schema_default(key))]


# data keys for an image classifier alone, and what each sets
# refused on text data (validate); the keys of IMAGE_ONLY are noted in a sweep over the model instead
IMAGE_AUGMENTATION = ("mixup", "cutmix", "erasing", "randaug")
IMAGE_ONLY = {"label_smoothing": "the image classifier's loss", "repeated_aug": "repeated augmentation of images",
              "img_size": "the images' size"}


def unread_data_reasons(cfg) -> dict[str, str]:
    """Every data key the chosen data set does not read (it declares ``reads``; a text data set
    reads no image setting), set or not, with why: what :func:`stabletrain.config.unread_reasons`
    is for the other groups' keys, so that a sweep's check (``cli.check_swept_keys_read``) sees
    them too."""
    entry = _data_entry(cfg)
    text = {f"data.{k}": f"it sets {what}, and this run trains on text (data={entry.name})"
            for k, what in {**IMAGE_ONLY, **dict.fromkeys(IMAGE_AUGMENTATION, "image augmentation")}.items()
            } if entry.info.get("kind") == "text" else {}
    reads = entry.info.get("reads")
    if reads is None:
        return text
    readers = {k: [e.name for e in DATASETS.entries() if k in (e.info.get("reads") or ())] for k in OPTION_KEYS}
    return {**{f"data.{k}": f"only data={'/'.join(readers[k])} reads it, and this run has data={entry.name}"
               for k in OPTION_KEYS if k not in reads}, **text}


def unread_data_notes(cfg, given: Collection[str] = ()) -> list[str]:
    """A note for each data key the chosen data set does not read, set away from its default or
    ``given`` on the command line (a sweep's point at the default is noted as the others are;
    ``data.path`` and ``data.root`` only in a sweep over ``data``: :func:`validate` refuses them
    elsewhere)."""
    why = unread_data_reasons(cfg)
    return [f"note: data.{k}={C.shown_value(cfg.data[k])} changes nothing: {why[f'data.{k}']}"
            for k in _unread_data_keys(cfg, given)]


def fit_model_to_data(cfg, data: Data) -> list[str]:
    """Class count, channels, image size (``data.img_size``) come from the data, and are
    written into ``cfg.model`` so that config.yaml records what is built. Returns the start
    message that says which values the data replaced."""
    m, notes = cfg.model, []
    if data.kind != "vision":
        if m.vocab_size < data.vocab_size:
            raise ConfigError(f"model.vocab_size={m.vocab_size} < the data's vocabulary {data.vocab_size}")
        padded = -(-data.vocab_size // 64) * 64  # nanoGPT's padding to a multiple of 64
        if m.vocab_size >= 2 * padded:  # a GPT-2 recipe on byte-level text: kept as the recipe says, but said
            notes.append(f"model.vocab_size={m.vocab_size} for data of {data.vocab_size} token ids: "
                         f"{m.vocab_size - data.vocab_size} embedding rows are never used (model.vocab_size="
                         f"{padded} would drop them)")
        return notes
    size = m.img_size if cfg.data.img_size is None else cfg.data.img_size
    wanted = {"num_classes": data.num_classes, "in_chans": data.in_chans, "img_size": size}
    changed = [f"model.{key}={value} (was {getattr(m, key)})" for key, value in wanted.items()
               if getattr(m, key) != value]
    if changed:
        notes.append(f"from the data (data={option_value(cfg.data.name)}): {', '.join(changed)}")
    with open_dict(cfg) if OmegaConf.is_config(cfg) else contextlib.nullcontext():
        for key, value in wanted.items():
            setattr(m, key, value)
    return notes


def load_initial_weights(cfg, model: torch.nn.Module, run_dir: Path) -> str:
    """``init_weights``' weights into ``model``, unless the run resumes a checkpoint; the start note."""
    # resume=auto, or a requeued job, that finds this run's last.pt resumes it or is refused: the source
    # is not read, so a requeued job goes on where its source has moved, and no note says "afresh"
    own = last_checkpoint(run_dir) if cfg.resume == "auto" or cfg.resume is None and D.may_be_requeued() else None
    if cfg.resume not in (None, "auto"):
        return f"init_weights={cfg.init_weights} is not loaded: resume={cfg.resume} continues that checkpoint's weights"
    if own is not None:
        return f"init_weights={cfg.init_weights} is not loaded: this run continues its own checkpoint, {own}"
    from stabletrain.models.weights import load_weights

    return load_weights(model, cfg.init_weights, cfg.model)


def spike_note(cfg) -> str:
    """What the divergence watch makes of debug.spike_at_step's spike, as configured."""
    dv, at = cfg.divergence, cfg.debug.spike_at_step
    head = f"debug.spike_at_step={at}: that step's loss is multiplied by {cfg.debug.spike_factor:g}; "
    if not dv.enabled:
        return head + "no loss spike is watched (divergence.enabled=false)"
    if at == 1:
        return head + "the first loss has none before it to be compared with: it is no spike to the divergence watch"
    if at <= dv.warmup_steps:
        return head + (f"in the first divergence.warmup_steps={dv.warmup_steps} steps a spike is named on the progress "
                       f"line, not counted")
    if dv.window <= 1:
        return head + (f"a spike of one step is a divergence (divergence.window={dv.window}): the run "
                       + ("rolls back" if dv.action == "rollback" else "stops"))
    return head + (f"a spike of one step is watched, not acted on (a divergence is {dv.window} steps in a row above "
                   f"{dv.spike_factor:g}x the running mean, divergence.window)")


def build_trainer(cfg, run_dir: str | Path, info: D.DistInfo | None = None) -> Trainer:
    """The trainer of ``cfg`` with everything built, on this process's device."""
    info = info or D.DistInfo()
    import_modules(cfg.imports)
    run_dir = Path(run_dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    device = D.pick_device(cfg.device, info)
    compiled = resolve_compile(cfg.compile, device)
    D.init(info, device, cfg.dist_timeout)
    prec = option_value(cfg.precision)
    bf16 = prec == "bf16" or (prec == "auto" and device.type == "cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    seed_all(cfg.seed)
    data = data_from_config(cfg)
    given = C.given_keys(task_overrides())  # a sweep's point at a key's default is noted as the others are
    notes = (fit_model_to_data(cfg, data) + C.unread_keys(cfg, own_groups(cfg), given) + unread_data_notes(cfg, given)
             + unread_kwargs_notes(cfg) + unread_model_keys(cfg.model, given)
             + MODELS.entry(cfg.model.family).info.get("notes", lambda m: [])(cfg.model))
    if not info.enabled and ("dist_timeout" in given or C.differs(cfg.dist_timeout, C.schema_default("dist_timeout"))):
        notes.append(f"note: dist_timeout={cfg.dist_timeout:g} changes nothing: this run is one process (it bounds "
                     f"how long a torchrun/srun job's collective waits for the other ranks)")
    model, reparam_hook = build_model_and_hook(cfg.model, Components.of(cfg))
    if cfg.init_weights is not None:  # before the weight average copies the model
        notes.append(load_initial_weights(cfg, model, run_dir))
    model = model.to(device)
    notes += unbuilt_components(model, cfg) + [n for n in [norm_without_layer_note(cfg)] if n]
    blocks = transformer_blocks(model)
    if cfg.activation_checkpointing:
        from stabletrain.engine.sharding import apply_activation_checkpointing

        n = apply_activation_checkpointing(blocks)
        notes.append(f"activation checkpointing: {n} block(s) recompute their activations in the backward pass"
                     if n else "activation_checkpointing=true changes nothing: the model has no transformer blocks")
    shard = _shard(cfg, info)
    autocast = autocast_for(device, bf16)
    sharded = cfg.parallel == "fsdp"
    if device.type == "cpu":  # out of memory, a CPU process is killed without a word
        with torch.random.fork_rng(devices=[]):  # a DataLoader's iterator draws its seed
            x = next(data.val_batches(2, 1))[0].to(device)
        tight = check_host_memory(model, x, shard.micro, autocast, compiled=compiled, dry_run=cfg.dry_run)
        notes += [tight] if tight else []
    ema = None
    if cfg.ema.decay is not None:  # a copy of the model before sharding, sharded alike below
        from stabletrain.engine.ema import WeightEma

        ema = WeightEma(model, cfg.ema.decay, cfg.ema.every, cfg.ema.warmup)
    if sharded:  # before the optimizer: FSDP2 replaces the parameters by sharded DTensors
        from stabletrain.engine.sharding import shard_model

        check_parallel(cfg, info.world)
        shard_model(model, blocks, bf16, device)
        if ema is not None:
            ema.shard(lambda m: shard_model(m, transformer_blocks(m), bf16, device))
        notes.append(f"parallel=fsdp: {len(blocks)} blocks and the root sharded over {info.world} ranks"
                     + (" (bf16 parameters, fp32 gradient reduction)" if bf16 else "")
                     + (", the weight average alike" if ema is not None else ""))
    optimizer, group_summary = build_optimizer(model, cfg.optim, cfg.model.family, cfg.reparam,
                                               batch_size=cfg.batch_size)
    spe = data.steps_per_epoch(cfg.batch_size)
    total = cfg.steps if cfg.steps is not None else max(1, int(round(cfg.epochs * spe)))
    lr_at = make_schedule(cfg.schedule, scaled_lr(cfg.optim, cfg.batch_size), total, warmup=cfg.warmup,
                          steps_per_epoch=spe)
    notes += [lr_at.describe(), *lr_at.warnings()] + ([part] if (part := eval_note(data, cfg)) else [])
    notes += [slow] if (slow := stablenorm_note(cfg)) else []
    notes += [n for n in (short_bound_note(cfg.optim, total), batch_over_data_note(data, cfg.batch_size)) if n]
    if cfg.monitor.rollback_on_alert and cfg.ckpt_every > cfg.monitor.probe_every:
        # an alert fires at a probe: the newest ring checkpoint before it may be ckpt_every back
        notes.append(f"note: monitor.rollback_on_alert with ckpt_every={cfg.ckpt_every} > monitor.probe_every="
                     f"{cfg.monitor.probe_every}: a rollback may restore a state long before the alert, or step 0; "
                     f"set ckpt_every={cfg.monitor.probe_every} or less")
    if cfg.debug.spike_at_step is not None:
        notes.append(spike_note(cfg))
    if ema is not None:
        notes.append(ema_note(cfg.ema, total))
    schedule = OptimizerSchedule(lr_at, cfg.optim.weight_decay, cfg.optim.weight_decay_end)
    notes += [wd] if (wd := schedule.describe_weight_decay()) else []
    mixup, criterion = task_loss(data, cfg.data)
    notes += [aug] if (aug := augment_line(cfg, data)) else []
    monitor = None
    if option_value(cfg.monitor.name) != "off":
        from stabletrain.monitor.runner import MonitorRunner

        probe = next(data.val_batches(cfg.monitor.probe_batch_size, 1))
        monitor = MonitorRunner(model, cfg.monitor, probe, device=device, autocast=autocast,
                                active=info.is_main, sharding=_monitor_sharding() if sharded else None)
        notes += [gap] if (gap := monitor.coverage()) else []
        acts = [k for k in ("rollback_on_alert", "stop_on_alert") if cfg.monitor[k]]
        if acts and "entropy" not in monitor.reads():  # an alert needs a block's attention entropy
            notes.append(f"monitor.{acts[0]}=true can never act: a health alert needs attention entropy, which the "
                         f"probe pass reads from stabletrain's attention only, and this model has none")
    per_tensor = hasattr(optimizer, "telemetry")  # AdamW²'s per-tensor rates, logged without monitors too
    sparse = StartNote(functools.partial(cadence_note, cfg.monitor, total, monitor.reads() if monitor else (),
                                         per_tensor))
    notes += [sparse] if sparse else []
    messages = [components_line(cfg), group_summary] + notes
    flops = MODELS.entry(cfg.model.family).info.get("flops")  # none registered: no MFU
    if cfg.steps is not None and cfg.epochs is not None:
        messages.append(f"steps={cfg.steps} overrides epochs={cfg.epochs:g}; set steps=null to train by epochs")
    settings = LoopSettings(
        total_steps=total, batch_size=cfg.batch_size, steps_per_epoch=spe, grad_clip=cfg.grad_clip,
        eval_every=cfg.eval_every, eval_batches=cfg.eval_batches, ckpt_every=cfg.ckpt_every,
        log_every=cfg.logger.log_every, adamw2_every=cfg.monitor.adamw2_every, resume=cfg.resume,
        resume_allow_changes=cfg.resume_allow_changes, bf16=bf16,
        compile=compiled, config_yaml=OmegaConf.to_yaml(cfg, resolve=True), title=cfg.model.name,
        flops_per_sample=float(flops(model, cfg.model)) if flops else 0.0,
        ckpt_keep=cfg.ckpt.keep, rollback_on_alert=cfg.monitor.rollback_on_alert,
        nan_at_step=cfg.debug.nan_at_step, spike_at_step=cfg.debug.spike_at_step,
        spike_factor=cfg.debug.spike_factor, sharded=sharded, equivalent=_equivalent_values(cfg),
        overrides=task_overrides())

    def open_sink(resume_step: int | None) -> Metrics:
        config_dict = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else None
        return Metrics(run_dir, cfg.logger, name=cfg.name, enabled=info.is_main, resume_step=resume_step,
                       config_dict=config_dict)

    return Trainer(model=model, optimizer=optimizer, schedule=schedule, data=data, shard=shard, criterion=criterion,
                   settings=settings, device=device, run_dir=run_dir, open_sink=open_sink, info=info,
                   loss_terms=build_loss_terms(cfg.regularizer),
                   step_hooks=[reparam_hook] if reparam_hook is not None else [],
                   mixup=mixup, ema=ema, monitor=monitor, divergence=DivergenceWatch(cfg.divergence),
                   messages=messages)


def unbuilt_components(model, cfg) -> list[str]:
    """A family of the user's own whose builder ignores ``components`` builds none of the chosen
    norm, attention or de-escalation, and may have no layers sigmaReparam or LocAteR find: said at
    the start, not trained silently without them."""
    family = MODELS.entry(cfg.model.family)
    if is_builtin(family):
        return []  # the tests build every option into every family of stabletrain's own
    notes, kinds = [], {type(m) for m in model.modules()}
    layer = NORMS.entry(cfg.norm.name).info.get("layer")
    asked = option_value(cfg.norm.name) != C.NormConfig().name  # the default: nothing was asked
    if asked and layer is not None and not any(issubclass(k, layer) for k in kinds):
        notes.append(f"norm={cfg.norm.name} changes nothing: model.family={family.name} built no {layer.__name__} "
                     f"(its builder does not use components.norm)")
    attention = option_value(cfg.attention.name)
    ours = any(hasattr(m, "probe") and hasattr(m, "q_norm") for m in model.modules())  # layers/attention.py's
    if attention != C.AttentionConfig().name and not ours:
        notes.append(f"attention={attention} changes nothing: model.family={family.name} built no attention of "
                     f"stabletrain's (its builder does not use components.attention)")
    if option_value(cfg.deescalate.name) != C.DeescConfig().name and not any(issubclass(k, Deescalate) for k in kinds):
        notes.append(f"deescalate={preset(cfg, 'deescalate')} changes nothing: model.family={family.name} built no "
                     f"de-escalation (its builder does not use components.deescalate)")
    return notes + _unreached_weights(model, cfg, family.name)


def _unreached_weights(model, cfg, family: str) -> list[str]:
    """What sigmaReparam and LocAteR find by module shape and a model of one's own may not have:
    a fused ``qkv`` linear with ``num_heads`` (their query/key rows), plain linears and convs."""
    notes = []
    what = "no attention with a fused qkv nn.Linear and num_heads (as timm's and stabletrain's have)"
    if option_value(cfg.reparam.name) == "sigma":  # stabletrain's: one of one's own may reach other layers
        if not any(parametrize.is_parametrized(m, "weight") for m in model.modules()):
            notes.append(f"reparam={preset(cfg, 'reparam')} changes nothing: model.family={family} has "
                         + ("no nn.Linear or nn.Conv2d it can normalise" if option_value(cfg.reparam.apply_to) ==
                            "all" else f"{what}, whose query/key rows it normalises"))
        elif any(isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None for m in model.modules()):
            notes.append(f"reparam={preset(cfg, 'reparam')} leaves nn.MultiheadAttention's in_proj_weight "
                         f"(its W_q, W_k, W_v) raw: it normalises nn.Linear and nn.Conv2d weights; give the "
                         f"attention a fused qkv nn.Linear and num_heads to have them normalised")
    if "locater" in (cfg.regularizer or {}) and not attention_layers(model):
        notes.append(f"regularizer=locater adds 0: model.family={family} has {what}, whose query/key "
                     f"weights it penalises")
    return notes


def norm_without_layer_note(cfg) -> str | None:
    """A norm of one's own registered without ``layer=``: nothing can tell its modules are norms."""
    entry = NORMS.entry(cfg.norm.name)
    if is_builtin(entry) or entry.info.get("layer") is not None:
        return None
    return (f"note: norm={entry.name} is registered without layer=: its modules are not known as norms, so their "
            f"weights are grouped as plain vectors, not norm gains (AdamW² leaves them unbounded); "
            f"register it with layer=<its nn.Module class>")


def _monitor_sharding():
    """How the monitors read an FSDP2-sharded model: engine/sharding.py's gathers and rank agreement."""
    from stabletrain.engine import sharding as S
    from stabletrain.monitor.runner import Sharding

    return Sharding(gathered=S.gathered, local=S.local, all_ranks=S.all_finite_everywhere)


def _shard(cfg, info: D.DistInfo) -> Shard:
    world = info.world
    micro = cfg.micro_batch_size or cfg.batch_size // world
    if micro == 0 or cfg.batch_size % (micro * world):
        # the nearest batch sizes that split evenly, as a fix to copy
        unit = cfg.micro_batch_size * world if cfg.micro_batch_size else world
        lower, upper = cfg.batch_size // unit * unit, -(-cfg.batch_size // unit) * unit
        fixes = [" or ".join(f"batch_size={b}" for b in dict.fromkeys((lower, upper)) if b > 0)]
        split = (f"micro_batch_size={micro}" if cfg.micro_batch_size else
                 f"its {world} rank(s)")
        per_rank = cfg.batch_size // world
        if cfg.micro_batch_size and cfg.batch_size % world == 0:
            # a resumed run cannot change its batch, but may its micro-batch: first the largest that divides
            fits = max(m for m in range(1, min(micro, per_rank) + 1) if per_rank % m == 0)
            fixes.insert(0, f"micro_batch_size={fits}")
        # nor its batch: the process counts that divide it, nearest first
        procs = sorted((n for n in range(1, 129) if n != world and cfg.batch_size % (n * (cfg.micro_batch_size or 1))
                        == 0), key=lambda n: (abs(n - world), n))[:2]
        fixes += [f"launch {' or '.join(map(str, sorted(procs)))} process(es)"] if procs else []
        raise ConfigError(f"batch_size={cfg.batch_size} does not split evenly over {split}"
                          + (f" x {world} rank(s)" if cfg.micro_batch_size else "") + f": use {', or '.join(fixes)}")
    if (cfg.data.mixup > 0 or cfg.data.cutmix > 0) and micro % 2:
        raise ConfigError(f"mixup/cutmix pair the samples of a micro-batch: micro-batch {micro} must be even "
                          f"(set batch_size or micro_batch_size so that each rank's micro-batch is even)")
    return Shard(cfg.batch_size, info.rank, world, cfg.batch_size // (micro * world))


