"""Command-line overrides checked before Hydra starts, so a mistake costs one clear line.

Hydra's own errors are multi-line (and its type errors name internal nodes); here the same
overrides are composed with Hydra's compose API (once, or for each point of a sweep) and
validated, and any problem is printed as ``error: <what> <fix>`` with exit code 2.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from contextvars import ContextVar
from math import prod
from pathlib import Path
from typing import NamedTuple

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class Primary(NamedTuple):
    """The config Hydra composes: the main folder (configs/, or --config-path's), the primary
    config's name in it (or in ``extra``) and ``extra``, --config-dir's folder, searched after the
    main one for the primary config and the groups' options alike."""

    dir: Path
    name: str
    extra: Path | None = None


DEFAULT = Primary(CONFIG_DIR, "train")
PRIMARY: ContextVar[Primary] = ContextVar("primary", default=DEFAULT)  # check_overrides sets it while it checks
_PASSTHROUGH_FLAGS = {"-m", "--multirun"}
# the groups whose options of one's own take arguments of their own in ``<group>.kwargs``
KWARGS_GROUPS = ("model", "norm", "attention", "init", "reparam", "deescalate", "optim", "schedule")


def config_dirs(overrides: list[str] = ()) -> list[Path]:
    """``configs/`` (or the primary config's folder) and the folders of the user's own options:
    ``hydra.searchpath=[file://DIR,...]`` on the command line, else in the primary config."""
    given = None
    for ov in overrides:
        key, _, value = ov.lstrip("+").partition("=")
        if key == "hydra.searchpath":
            given = [v.strip().strip("'\"") for v in value.strip().strip("[]").split(",")]
    given = _primary_searchpath() if given is None else given
    primary = PRIMARY.get()
    return [primary.dir, *([primary.extra] if primary.extra else []),
            *(Path(v[len("file://"):]) for v in given if v.startswith("file://"))]


def _primary_file(primary: Primary) -> Path:
    here = primary.dir / f"{primary.name}.yaml"
    return here if here.is_file() or primary.extra is None else primary.extra / f"{primary.name}.yaml"


def _primary_searchpath() -> list[str]:
    """The ``hydra.searchpath`` a primary config of one's own sets in its yaml (train.yaml sets none)."""
    import yaml

    primary = PRIMARY.get()
    if primary == DEFAULT:
        return []
    try:
        found = (yaml.safe_load(_primary_file(primary).read_text()) or {}).get("hydra", {}).get("searchpath")
    except (OSError, yaml.YAMLError, AttributeError):
        return []
    return [str(v) for v in found] if isinstance(found, list) else []


def is_group(name: str, overrides: list[str] = ()) -> bool:
    return any((d / name).is_dir() for d in config_dirs(overrides))


def group_options(group: str, overrides: list[str] = ()) -> list[str]:
    """The options of config group ``group``: its yaml files in ``configs/`` and the searchpath's folders."""
    return sorted({p.stem for d in config_dirs(overrides) for p in (d / group).glob("*.yaml")})


# a sweep of at most this many points is checked point by point before it starts (0.1 s each);
# a larger one checks every value once, with the others at their first
CHECK_EVERY_POINT = 256


def _sweep_points(overrides: list[str]) -> list[list[str]]:
    """The override lists to check before a sweep starts, so that a bad point is found then, not
    when it comes up (a local sweep stops at the first point that fails): every point of the
    sweep, or for a large one every value of every swept key, the others at their first."""
    import itertools
    import math

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    from stabletrain.errors import ConfigError

    first, values = [], []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_hydra_override():
            if o.get_key_element() == "hydra.searchpath":  # the user's own options: composing needs them
                first.append(o.input_line)
            continue
        if o.is_sweep_override():
            key = o.get_key_element()
            if o.is_interval_sweep():  # a sampling sweeper's (optuna, nevergrad): it draws the values
                if not any(x.startswith("hydra/sweeper=") and x != "hydra/sweeper=basic" for x in overrides):
                    raise ConfigError(f"{o.input_line}: interval() is for a sweeper that samples (hydra/sweeper="
                                      f"optuna with hydra-optuna-sweeper installed); Hydra's basic sweeper takes "
                                      f"a list of values ({key}=a,b,c), range() or choice()")
                continue
            if isinstance(o.value(), Glob):  # the group's options it picks: Hydra's loader lists them
                options = group_options(o.key_or_group, overrides)
                vals = [f"{key}={v}" for v in o.value().filter(options)]
                if not vals:
                    raise ConfigError(f"{o.input_line} picks none of {o.key_or_group}'s options "
                                      f"({', '.join(options) or 'it is no group'})")
            else:
                vals = [f"{key}={v}" for v in o.sweep_string_iterator()]
            values.append((len(first), vals[1:]))
            first.append(vals[0])
        else:
            first.append(o.input_line)
    if math.prod(len(others) + 1 for _, others in values) <= CHECK_EVERY_POINT:
        slots = [[x] for x in first]
        for i, others in values:
            slots[i] += others
        return [list(p) for p in itertools.product(*slots)]
    points = [first]
    for i, others in values:
        points += [first[:i] + [v] + first[i + 1:] for v in others]
    return points


def explain(err: Exception, overrides: list[str]) -> str:
    """One line for a Hydra/OmegaConf composition error."""
    from hydra.errors import MissingConfigException

    text = str(err)
    if isinstance(err, MissingConfigException) or "Could not find" in text:
        for ov in overrides:
            key, _, val = ov.lstrip("+~").partition("=")
            if "." not in key and is_group(key, overrides) and val not in group_options(key, overrides):
                mine = config_dirs(overrides)[1:]  # the searchpath's folders, after configs/
                own = any(o.startswith("imports=") for o in overrides)
                hint = (f" (looked in {', '.join(map(str, mine))} too: an option of your own is DIR/{key}/{val}.yaml, "
                        f"DIR being a searchpath folder)" if mine else
                        f" (an option of your own: DIR/{key}/{val}.yaml and hydra.searchpath=[file://DIR])" if own
                        else "")
                options = group_options(key, overrides)
                items = [v.strip() for v in val[1:-1].split(",")] if val.startswith("[") and val.endswith("]") else []
                bad = next((v for v in items if v not in options), None)
                near = difflib.get_close_matches(bad or val, options, n=1, cutoff=0.7)
                said = (f"{key}={val}: {bad} is not an option of '{key}'" if bad is not None
                        else f"{key}={val} is not an option of '{key}'")  # a list names the one that is not
                return (f"{said}; choose {'from' if bad is not None else 'one of'}: {', '.join(options)}"
                        + (f" (did you mean {near[0]}?)" if near else "") + hint)
    from stabletrain.errors import ConfigError

    link = err
    while link is not None:  # a ConfigError raised inside composition (a recipe's ${required:})
        if isinstance(link, ConfigError):
            return str(link)
        link = link.__cause__ or link.__context__
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    msg = str(cause).strip().splitlines()
    first = msg[0] if msg else type(cause).__name__
    key = next((ln.split(":", 1)[1].strip() for ln in msg if ln.strip().startswith("full_key:")), None)
    within = re.match(r"In '([\w./-]+)': ValidationError raised while composing config:", first)
    if within and len(msg) > 1:  # a value in a yaml (of one's own): the reason is the next line
        wrong = _wrong_type(key, msg[1]) if key else None
        return f"{within.group(1)}.yaml: {wrong or (f'{key}: ' if key else '') + msg[1].strip()}"
    yaml = re.match(r"In '([\w./-]+)': ConfigKeyError", first)
    if yaml and key:  # a yaml of the user's own sets a key the schema lacks
        hint = _nearest_key(key) or "not in the config schema (`python train.py --cfg job` prints every key)"
        return f"{yaml.group(1)}.yaml sets unknown key '{key}': {hint}"
    chosen = re.match(r"Multiple values for ([\w/]+)\.", first)
    added = chosen and next((ov for ov in overrides if ov.startswith(f"+{chosen.group(1)}=")), None)
    if added:  # +experiment=X; a yaml's defaults list choosing a group again keeps Hydra's own line
        return (f"{added}: the group {chosen.group(1)} is in train.yaml's defaults already, so its option is "
                f"chosen without the '+': {added[1:]}")
    if (have := re.match(r"Could not append to config\. An item is already at '([\w.]+)'", first)) is not None:
        return (f"+{have.group(1)} adds a key that is there already (set by its option's yaml): drop the '+' to set "
                f"it, or write '++{have.group(1)}=...', which sets it either way")
    if "not in struct" in text or "is not in struct" in first or "Could not override" in text:
        keys = sorted((ov.split("=")[0] for ov in overrides), key=len, reverse=True)  # model.nope before model
        bad = next((k for k in keys if k.lstrip("+~") in text), None)
        term = (bad or "").lstrip("+~").split(".")
        rest = _composed([o for o in overrides if o.split("=")[0] != bad])  # the config without the bad key
        if len(term) > 2 and term[0] == "regularizer" and term[1] in group_options("regularizer", overrides):
            if rest is not None and term[1] in (rest.regularizer or {}):
                return f"unknown key '{bad}': {_nearest_term_key(rest, term[1], term[2])}"
            chosen = next((o for o in overrides if o.split("=")[0].lstrip("+~") == "regularizer"), None)
            # a sweep point without the term, of a sweep with and without it: that point cannot take it
            swept = (f"; in a sweep with and without it, the points without it ({chosen}) cannot take its "
                     f"parameters: sweep them under regularizer={term[1]} (a coefficient of 0 turns its part off), "
                     f"or launch those points as a command of their own") if chosen else ""
            return (f"{bad} sets a parameter of the {term[1]} loss term, which is not active: add "
                    f"regularizer={term[1]} (several: regularizer=[{term[1]},...]){swept}")
        if len(term) > 2 and term[1] == "kwargs" and term[0] in KWARGS_GROUPS:

            group = term[0]
            given = list(rest[group].kwargs) if rest is not None and rest[group].get("kwargs") else []
            near = difflib.get_close_matches(term[2], given, n=1, cutoff=0.6)
            if near:
                return f"unknown key '{bad}': did you mean {group}.kwargs.{near[0]}?"
            if (refused := _own_kwarg_refused(rest, group, term[2])) is not None:
                return refused  # the '+' would only meet this refusal
            return f"{bad} is a new argument in {group}.kwargs: add it with a '+', +{bad}=VALUE"
        if bad is None:  # a yaml's own (a defaults list overriding a group the primary config lacks)
            return first
        hint = _nearest_key(bad.lstrip("+~"))
        if hint:
            return f"unknown key '{bad}': {hint}"
        top = sorted(p.name for p in PRIMARY.get().dir.iterdir() if p.is_dir())
        return (f"unknown key '{bad}': not in the config schema (groups: {', '.join(top)}; "
                f"`python train.py --cfg job` prints every key)")
    if key and "is not a ListConfig" in first:
        return f"{key} takes a list: write it in brackets, {key}=[x,y,...]"
    if key and (wrong := _wrong_type(key, first)):
        return wrong
    return f"{key}: {first}" if key else first


def _own_kwarg_refused(cfg, group: str, name: str) -> str | None:
    """Why ``<group>.kwargs.<name>`` is refused by the option chosen, which declares its
    arguments, from the check the run makes; None where it may be, or the config holds another
    mistake."""
    from omegaconf import OmegaConf, open_dict

    from stabletrain.build import validate
    from stabletrain.errors import ConfigError

    if cfg is None:
        return None
    trial = OmegaConf.create(OmegaConf.to_container(cfg))
    with open_dict(trial):
        trial[group].kwargs = {**(trial[group].get("kwargs") or {}), name: 0}
    try:
        validate(trial)
    except ConfigError as e:
        # not stabletrain's own option's refusal of any kwargs: in a sweep over the group the '+' is right
        return str(e) if str(e).startswith(f"{group}.kwargs.{name}: ") else None
    except Exception:
        return None
    return None


def _composed(overrides: list[str]):
    """The config of ``overrides``, or None when they hold another error (the first one is told)."""
    try:
        return compose_config(overrides)
    except Exception:
        return None


def _nearest_term_key(cfg, term: str, leaf: str) -> str:
    """``did you mean regularizer.zloss.coef?``, else the term's parameters: its dataclass's, or
    where the module registering it cannot be imported here, its yaml's."""

    from stabletrain.losses import LOSS_TERMS
    from stabletrain.registry import import_modules

    try:
        import_modules(cfg.imports)
        keys = list(LOSS_TERMS.entry(term).info["params"].__dataclass_fields__)
    except Exception:
        keys = list(cfg.regularizer[term] or {})
    near = difflib.get_close_matches(leaf, keys, n=1, cutoff=0.6)
    return (f"did you mean regularizer.{term}.{near[0]}?" if near
            else f"the {term} loss term's parameters are: {', '.join(keys)}")


def _wrong_type(key: str, first: str) -> str | None:
    """``optim.lr=fast must be a number, e.g. optim.lr=0.001`` for OmegaConf's type errors."""
    import re

    given = re.search(r"[Vv]alue '(.*?)'", first)
    given = given.group(1) if given else "?"
    if "is not Optional" in first:  # optim.lr=null
        from stabletrain.config import schema_default, shown_value

        try:
            default = schema_default(key)
        except KeyError:  # a key of a yaml of one's own
            return f"{key}=null: {key} needs a value"
        return f"{key}=null: {key} needs a value, e.g. {key}={shown_value(default)}, or leave it out"
    if (choices := re.search(r"expected one of \[(.*)\]", first)):
        return f"{key}={given} is not one of: {choices.group(1)}"
    kind = next((k for t, k in (("to Integer", "an integer"), ("to Float", "a number"),
                                ("valid bool", "true or false")) if t in first), None)
    if kind is None:
        return None
    whole = _whole_number(given) if kind == "an integer" else None
    if whole is not None:  # steps=1e3: the grammar reads a float
        return (f"{key}={given} must be an integer, written without an exponent or a decimal point: "
                f"{key}={whole}")
    from stabletrain.config import schema_default

    try:
        default = schema_default(key)
    except KeyError:  # a key of a yaml of one's own
        default = ...
    if default is None:  # optim.tau, grad_clip: a number, or null (off, or derived)
        return f"{key}={given} must be {kind}, or null"
    example = str(default).lower() if isinstance(default, bool) else default if isinstance(default, (int, float)) \
        else None
    elsewhere = ""
    if key.startswith("model."):  # model.num_heads=[3,6]: a family may set it per stage under its own key
        from stabletrain.models.registry import counterparts

        elsewhere = "".join(f"; under model.family={fam} its counterpart is model.{own}"
                            for fam, own in counterparts(key[len("model."):]))
    return f"{key}={given} must be {kind}" + (f", e.g. {key}={example}" if example is not None else "") + elsewhere


def _whole_number(text: str) -> int | None:
    """``1000`` for ``1000.0`` (what ``1e3`` becomes), None for anything else."""
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


def schema_keys(node=None, prefix: str = "") -> list[str]:
    """Every dotted key of the typed schema (``optim.lr``, ``divergence.spike_factor``, ...)."""
    import dataclasses
    import typing

    from stabletrain.config import TrainConfig

    node = node or TrainConfig
    keys = []
    for name, hint in typing.get_type_hints(node).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(hint):
            keys += schema_keys(hint, f"{prefix}{name}.")
    return keys


# the settings of nanoGPT's and timm's train.py whose names differ here (names the schema finds
# by itself, dropout or weight_decay, are not repeated): name -> (whose, the key here)
FOREIGN_KEYS = {
    **{name: ("nanoGPT", key) for name, key in {
        "n_embd": "model.embed_dim", "n_layer": "model.depth", "n_head": "model.num_heads",
        "max_iters": "steps", "learning_rate": "optim.lr", "warmup_iters": "warmup",
        "lr_decay_iters": "schedule.horizon (the cosine's length, when it differs from the run's)",
        "beta1": "optim.betas=[B1,B2]", "beta2": "optim.betas=[B1,B2]", "eval_interval": "eval_every",
        "log_interval": "logger.log_every", "eval_iters": "eval_batches", "dtype": "precision (auto, bf16 or fp32)",
        "gradient_accumulation_steps": "micro_batch_size: batch_size is per optimizer step, and "
                                       "micro_batch_size=batch_size/N accumulates N micro-batches",
        "init_from": "resume (auto, or a checkpoint's path), or init_weights=PATH for the weights only: a run, "
                     "nanoGPT's out_dir, a Hugging Face GPT-2 folder",
        "out_dir": "hydra.run.dir",
        "wandb_log": "logger=wandb_online (wandb logs offline by default)", "wandb_project": "logger.project"}.items()},
    **{name: ("timm", key) for name, key in {
        "opt": "optim", "sched": "schedule", "drop_path_rate": "model.drop_path", "smoothing": "data.label_smoothing",
        "initial_checkpoint": "init_weights (the weights only; resume continues a run)",
        "clip_grad": "grad_clip", "warmup_epochs": "warmup with schedule.unit=epochs", "reprob": "data.erasing",
        "aa": "data.randaug", "data_dir": "data.root (with data=imagefolder)", "model_ema_decay": "ema.decay",
        "model_ema": "ema.decay (null is off)", "workers": "data.num_workers"}.items()},
}


def _nearest_key(bad: str) -> str | None:
    """``did you mean optim.lr?`` for a misspelt key (or node), else the keys of the node it names."""

    leaf = bad.rpartition(".")[2]
    if leaf in FOREIGN_KEYS:  # model.n_embd, max_iters
        whose, key = FOREIGN_KEYS[leaf]
        return f"here, {whose}'s {leaf} is {key}"
    if "-" in bad:  # timm's drop-path
        return f"keys are written with '_': {_nearest_key(bad.replace('-', '_')) or bad.replace('-', '_')}"
    keys = schema_keys()
    nodes = {k.rpartition(".")[0] for k in keys}
    parent, _, leaf = bad.rpartition(".")
    if parent not in nodes:  # otpim.lr: the node misspelt
        near = difflib.get_close_matches(parent, sorted(nodes - {""}), n=1, cutoff=0.6)
        if near and f"{near[0]}.{leaf}" in keys:
            return f"did you mean {near[0]}.{leaf}?"
        rest = bad.partition(".")[2]  # train.imports, cfg.steps: a prefix that is no node of the config
        if rest in keys:
            return f"did you mean {rest}?"  # (top-level keys have no prefix)
        return _nearest_key(rest) if rest and not near else None  # train.max_step: as max_step would be
    leaves = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    if leaf.lower() in leaves:  # optim.LR: keys are lower case
        return f"did you mean {parent + '.' if parent else ''}{leaf.lower()}?"
    near = [x for x in leaves if x.startswith(leaf)] if leaf else []
    near = near if len(near) == 1 else difflib.get_close_matches(leaf, leaves, n=1, cutoff=0.6)
    if near:
        return f"did you mean {parent + '.' if parent else ''}{near[0]}?"
    if parent:
        return f"{parent} has no such key; its keys: {', '.join(leaves)}"
    elsewhere = [k for k in keys if k.endswith("." + leaf)]  # lr=0.1 for optim.lr=0.1
    return f"did you mean {' or '.join(elsewhere)}?" if elsewhere else None


def compose_config(overrides: list[str], with_hydra: bool = False):
    """The config ``python train.py OVERRIDES`` would run, composed without starting Hydra
    (``with_hydra``: its ``hydra`` node too: the help page's text). The search path is the one
    Hydra builds from train.py's flags: the main folder, then --config-dir's, then the schema."""
    from hydra import compose, version
    from hydra._internal.hydra import Hydra
    from hydra.core.global_hydra import GlobalHydra

    from stabletrain.config import register

    register()
    GlobalHydra.instance().clear()
    version.setbase("1.3")
    try:
        Hydra.create_main_hydra2(task_name="app", config_search_path=_search_path())
        return compose(PRIMARY.get().name, overrides=epochs_over_steps(list(overrides)), return_hydra_config=with_hydra)
    finally:
        GlobalHydra.instance().clear()


def _search_path():
    """The search path Hydra builds from train.py's flags: the main folder, then --config-dir's, then the schema."""
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    primary = PRIMARY.get()
    search = create_config_search_path(str(primary.dir))
    if primary.extra is not None:
        search.prepend(provider="command-line", path=f"file://{primary.extra}",
                       anchor=SearchPathQuery(provider="schema"))
    return search


def hydra_group_options(group: str, overrides: list[str] = ()) -> list[str]:
    """The options of one of Hydra's own groups (``hydra/launcher``): configs/'s, Hydra's and its
    plugins' (submitit_slurm) as Hydra's config loader lists them, and the searchpath folders'."""
    from hydra._internal.hydra import Hydra
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        Hydra.create_main_hydra2(task_name="app", config_search_path=_search_path())
        found = GlobalHydra.instance().config_loader().get_group_options(group)
    finally:
        GlobalHydra.instance().clear()
    return sorted({*found, *group_options(group, overrides)})


def checked_config(overrides: list[str]):
    """:func:`compose_config` for the scripts: a mistake in ``overrides`` (an unknown model, a
    misspelt key, a value out of range) ends the script in the line train.py would print."""
    if isinstance(overrides, str):  # read one character at a time, it said "cannot parse 'm'"
        _fail(f"checked_config takes a list of overrides: checked_config({overrides.split()!r})")
    check_overrides(list(overrides))
    return compose_config(overrides)


# characters a word processor or a paper puts in, and what the override grammar takes
_ASCII = str.maketrans({"²": "2", "³": "3", "–": "-", "—": "-", "−": "-", "‘": "'", "’": "'", "“": '"', "”": '"',
                        "×": "x", "\u00a0": " "})


def _plain_parse_error(overrides: list[str], err: Exception) -> str:
    """The override Hydra's grammar refused, and what it likely lacks: a value, or a value after a comma."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_overrides([o])
        except Exception:
            key = o.lstrip("+~")
            if "=" not in o and not o.startswith("~"):
                return f"cannot parse {o}: an override is key=value; write {key}=VALUE"
            if o.rstrip().endswith(","):
                return f"cannot parse {o}: it ends in a comma; a sweep (-m) lists values a,b with one after each comma"
            return f"cannot parse {o}: {str(err).splitlines()[0]}"
    return f"cannot parse the overrides: {str(err).splitlines()[0]}"


def _parse_error(overrides: list[str], err: Exception) -> str:
    """Hydra's lexer error in one line; a character outside ASCII (optim=adamw², a pasted dash) is
    named, with the override it likely meant."""
    odd = next((o for o in overrides if not o.isascii()), None)
    if odd is None:
        return _plain_parse_error(overrides, err)
    char = next(c for c in odd if not c.isascii())
    fixed = odd.translate(_ASCII)
    return (f"cannot parse {odd}: the override grammar takes no '{char}'"
            + (f"; did you mean {fixed}?" if fixed.isascii() else " (quote a value that needs it)"))


def _swept(overrides: list[str]) -> list[str]:
    """The overrides that give several values (``optim.lr=1e-3,1e-2``, ``range()``, ``choice()``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [o.input_line for o in OverridesParser.create().parse_overrides(overrides)
            if not o.is_hydra_override() and o.is_sweep_override()]


# the command-line flags Hydra's own argparse takes (an override has no dashes)
HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p", "--info",
               "-i", "--run", "-r", "--multirun", "-m", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}


def _take_flag(argv: list[str], names: tuple[str, ...]) -> tuple[list[str], str | None]:
    """``argv`` without Hydra's flag ``names`` and its value (``--config-dir DIR``, ``-cd=DIR``), and that value."""
    rest, found, i = [], None, 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in names:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if eq else 2
            continue
        rest.append(argv[i])
        i += 1
    return rest, found


def _config_flags(argv: list[str]) -> tuple[list[str], Primary | None]:
    """``argv`` without ``--config-dir``, ``--config-path`` and ``--config-name``, and the config
    they choose, found as Hydra finds it: a relative path from train.py's folder, the name in that
    folder or else in --config-dir's. None for a package's (``pkg://``), left to Hydra."""
    argv, own_dir = _take_flag(argv, ("--config-dir", "-cd"))
    if own_dir is not None and not Path(own_dir).is_dir():
        _fail(f"--config-dir {own_dir}: no such folder; give the folder that holds your groups' folders (model/, ...)")
    argv, path = _take_flag(argv, ("--config-path", "-cp"))
    argv, name = _take_flag(argv, ("--config-name", "-cn"))
    config_dir, config_name, extra = PRIMARY.get()
    extra = Path(os.path.abspath(own_dir)) if own_dir is not None else extra
    if path is not None and path.startswith("pkg://"):
        return argv, None
    if path is not None:
        config_dir = Path(path) if Path(path).is_absolute() else (CONFIG_DIR.parent / path).resolve()
        if not config_dir.is_dir():
            _fail(f"--config-path {path}: no such folder ({config_dir}; a relative path is read from train.py's "
                  f"folder, {CONFIG_DIR.parent}); give the folder that holds your primary config")
    if name is None:
        if path is not None and not (config_dir / f"{config_name}.yaml").is_file():
            _fail(f"--config-path {path}: {config_dir} holds no {config_name}.yaml; add one (copy configs/train.yaml) "
                  f"or name yours with --config-name")
        return argv, Primary(config_dir, config_name, extra)
    config_name = name.removesuffix(".yaml")
    group, _, option = config_name.rpartition("/")
    if group and (CONFIG_DIR / group).is_dir():
        _fail(f"--config-name {name}: {group}/ holds the options of a group, chosen with {group}={option} (the primary "
              f"config is a whole run's, like configs/train.yaml)")
    where = [config_dir, *([extra] if extra else [])]
    if not any((d / f"{config_name}.yaml").is_file() for d in where):
        options = sorted({p.stem for d in where for p in d.glob("*.yaml")})
        _fail(f"--config-name {name}: no {config_name}.yaml in {' or '.join(map(str, where))}"
              + (f"; the configs there: {', '.join(options)}" if options else ""))
    return argv, Primary(config_dir, config_name, extra)


def _as_override(argv: list[str], i: int) -> tuple[str, str]:
    """``--model vit_b`` or ``--drop-path=0.1`` (timm's, argparse's), and the override it likely
    meant: ``model=vit_b``, ``model.drop_path=0.1``."""
    given = argv[i]
    flag, _, value = given.lstrip("-").partition("=")
    if not value and i + 1 < len(argv) and not argv[i + 1].startswith("-") and "=" not in argv[i + 1]:
        value = argv[i + 1]
        given += f" {value}"
    name = flag.replace("-", "_")
    hint = _nearest_key(name) or ""
    if name in FOREIGN_KEYS:
        name = FOREIGN_KEYS[name][1].split()[0].rstrip(":")
        if "=" in name:  # logger=wandb_online, optim.betas=[B1,B2]: the override itself
            return given, name
    elif hint.startswith("did you mean ") and " or " not in hint:
        name = hint.removeprefix("did you mean ").rstrip("?")
    return given, f"{name}={value or 'VALUE'}"


def epochs_over_steps(argv: list[str]) -> list[str]:
    """``epochs=E`` given without ``steps`` trains E epochs: train.yaml's ``steps: 600`` (or a
    recipe's) would otherwise win, said only by a start line. ``steps=null`` goes right after the
    ``epochs`` override, among the overrides: after a flag (``--cfg job``) argparse refuses it."""
    given = {a.split("=", 1)[0].lstrip("+~"): a.split("=", 1)[1] for a in argv if "=" in a and not a.startswith("-")}
    if "epochs" in given and "steps" not in given and given["epochs"].lower() not in ("null", "none", ""):
        at = next(i for i, a in enumerate(argv)
                  if not a.startswith("-") and a.split("=", 1)[0].lstrip("+~") == "epochs")
        return [*argv[:at + 1], "steps=null", *argv[at + 1:]]
    return argv


def check_overrides(argv: list[str]) -> None:
    from stabletrain.topology import sweep_flag

    _, shown = _take_flag(argv, ("--cfg", "-c"))
    resolving = "--resolve" in argv
    if resolving and shown is None and not {"--help", "-h"} & set(argv):
        _fail("--resolve goes with --cfg: --cfg job --resolve prints the run's config with every ${...} resolved")
    sweep = sweep_flag(argv)
    multirun = sweep is not None
    printing = shown is not None
    if multirun and printing:
        _fail(f"--cfg prints the config of one run, and {sweep} launches a sweep: drop {sweep} to print one point's "
              f"config")
    argv = _without_cfg_flag(argv)  # `--cfg job` prints the config these checks pass
    foreign = next((i for i, a in enumerate(argv) if a.startswith("--") and a.split("=")[0] not in HYDRA_FLAGS), None)
    if foreign is not None:  # argparse's usage block named the flag's value among the "unrecognized arguments"
        given, meant = _as_override(argv, foreign)
        _fail(f"{given}: train.py takes overrides key=value, without dashes: {meant}")
    argv, primary = _config_flags(argv)
    if primary is None:
        return  # a package's primary config: Hydra's own business
    import yaml

    token = PRIMARY.set(primary)
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        if primary != DEFAULT:
            _check_primary(primary, [o for o in overrides if o.lstrip("+").startswith("hydra.searchpath=")])
        _check_overrides(argv, multirun, printing)
        if shown == "hydra" and resolving:
            _check_hydra_resolves(overrides)
    except yaml.YAMLError as e:  # a yaml of one's own (Hydra's loader refuses duplicate keys too)
        _fail(_unparsable(primary, overrides, e))
    finally:
        PRIMARY.reset(token)
    if twice := given_twice(overrides):
        print(twice, file=sys.stderr)


def given_twice(overrides: list[str]) -> str | None:
    """The note for a key given more than once (a base command with overrides appended): Hydra
    takes the last, without a word."""
    seen: dict[str, list[str]] = {}
    for o in overrides:
        if "=" in o:
            seen.setdefault(o.split("=", 1)[0].lstrip("+~"), []).append(o)
    repeated = [given for given in seen.values() if len(given) > 1]
    if not repeated:
        return None
    return "note: " + "; ".join(f"{', then '.join(given)}: the last counts" for given in repeated)


def _check_primary(primary: Primary, searchpath: list[str]) -> None:
    """A primary config of one's own composes into the schema: without ``train_schema`` first in its
    defaults list, every key would be "not in struct" and the run fail on the first it reads."""
    import yaml

    try:
        cfg = compose_config(searchpath)
    except yaml.YAMLError:
        raise
    except Exception:  # noqa: BLE001 - its mistakes are told by the checks that follow
        return
    if "imports" not in cfg:
        _fail(f"{_primary_file(primary)} is not a run's config: its defaults list lacks train_schema (the first "
              f"entry of configs/train.yaml's, which types every key)")


def _unparsable(primary: Primary, overrides: list[str], err) -> str:
    """One line for a yaml Hydra's loader refused, naming the file: the primary config, or the
    option of a group an override chose."""
    import yaml
    from omegaconf._utils import get_yaml_loader

    files = [_primary_file(primary)]
    for ov in overrides:
        key, _, value = ov.lstrip("+~").partition("=")
        if "." not in key and is_group(key, overrides):
            files += [f for v in value.strip("[]").split(",") if (f := option_yaml(key, v.strip(), overrides))]
    for f in files:
        try:
            yaml.load(f.read_text(), Loader=get_yaml_loader())
        except yaml.YAMLError as e:
            err = e
            break
        except OSError:
            continue
    else:
        f = None
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f"{f}" if f is not None else f"{files[0]} or a yaml file of the options chosen"
    return f"{where} does not parse: {problem}" + (f" at line {mark.line + 1}" if mark else "")


def _check_hydra_resolves(overrides: list[str]) -> None:
    """``--cfg hydra --resolve`` resolves Hydra's node with the run's keys dropped (Hydra's way):
    a run directory that reads one (train.yaml's ``${name}``) fails there with a traceback."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import InterpolationKeyError

    try:
        node = OmegaConf.create({"hydra": OmegaConf.to_container(compose_config(overrides, with_hydra=True).hydra)})
    except Exception:  # noqa: BLE001 - a composition problem: told by the checks before this one
        return
    def unresolvable(node, at: str) -> str | None:
        for k in node.keys() if isinstance(node, DictConfig) else range(len(node)):
            try:
                value = node[k]
            except InterpolationKeyError:
                return f"{at}{k}"
            if isinstance(value, (DictConfig, ListConfig)) and (found := unresolvable(value, f"{at}{k}.")):
                return found
        return None

    try:
        OmegaConf.resolve(node)
    except InterpolationKeyError as e:
        missing = re.search(r"'([\w.]+)'", str(e))
        key = unresolvable(node, "") or "a key"
        _fail(f"--cfg hydra --resolve: Hydra resolves its node without the run's keys, and {key} reads "
              f"{'${' + missing.group(1) + '}' if missing else 'one'}; set {key} on the command line, print it "
              f"unresolved (--cfg hydra), or resolved within the whole config (--cfg all --resolve)")
    except Exception as e:  # noqa: BLE001 - an ${oc.env:...} that is not set, ...
        _fail(f"--cfg hydra --resolve: {str(e).strip().splitlines()[0]}")


def _check_overrides(argv: list[str], multirun: bool, printing: bool) -> None:
    """check_overrides' work, once the flags that choose the config are read."""
    if "--help" in argv or "-h" in argv:
        given = [a for a in argv if not a.startswith("-")]
        print_own_options(given)
        if (text := help_text(given)) is not None:
            print(text)
            raise SystemExit(0)
        argv = [a for a in argv if a not in ("--help", "-h")]  # the overrides' mistake, told below in one line
    if any(a.startswith("-") and a not in _PASSTHROUGH_FLAGS for a in argv):
        return  # --info, --package ...: Hydra's own business
    overrides = [a for a in argv if not a.startswith("-")]
    if not (multirun or printing) and any(a.startswith("hydra/launcher=") and a != "hydra/launcher=basic"
                                          for a in overrides):
        # Hydra uses a launcher for -m only: a single run trains here, on the login node
        _fail(f"{next(a for a in overrides if a.startswith('hydra/launcher='))} launches the points of a sweep: add -m "
              f"(a single run is a one-point sweep), or drop it to train here")
    for ov in overrides:  # Hydra's own groups: composed only when Hydra starts, after these checks
        group, _, option = ov.lstrip("+").partition("=")
        if group.startswith("hydra/") and option and option not in (options := hydra_group_options(group, overrides)):
            near = difflib.get_close_matches(option, options, n=1, cutoff=0.6)
            _fail(f"{group}={option} is not an option of '{group}'; choose one of: {', '.join(options)}"
                  + (f" (did you mean {near[0]}?)" if near else ""))
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from stabletrain.build import validate
    from stabletrain.errors import ConfigError, first_line

    try:
        points = _sweep_points(overrides)
    except ConfigError as e:
        _fail(str(e))
    except Exception as e:
        _fail(_parse_error(overrides, e))
    if not multirun and (several := _swept(overrides)):
        _fail(f"{several[0]} gives several values: "
              + ("--cfg prints the config of one run: give it one" if printing else
                 "add -m to run one point per value (a list value is [a,b]; a string with a comma is quoted)"))
    try:
        check_keys(overrides)
        check_option_names(overrides)
        for p in points:  # with the point's hydra.searchpath: a group of one's own is a group
            check_values(p)
    except ConfigError as e:
        _fail(str(e))
    swept = [i for i in range(len(points[0])) if len({p[i] for p in points}) > 1]
    # the groups whose option a sweep varies (data=auto,tokens; norm.name=a,b): a setting given to
    # all points for one of its options (data.path, norm.kwargs.X) is noted at the others
    swept_groups = {k.removesuffix(".name").removesuffix(".family") for i in swept
                    if "." not in (k := points[0][i].split("=")[0].lstrip("+~")) or k.endswith((".name", ".family"))}

    def where(ovs: list[str]) -> str:
        return f" (sweep point {' '.join(ovs[i] for i in swept)}; no point was launched)" if swept else ""

    configs = []
    for ovs in points:
        try:
            cfg = compose_config(ovs)
            check_group_choices(cfg, ovs)
            validate(cfg, swept=swept_groups)
        except ConfigError as e:
            _fail(str(e) + _named_in_yaml(str(e), ovs) + where(ovs))
        except (OmegaConfBaseException, HydraException) as e:  # composition, or a value resolved lazily
            line = explain(e, ovs)
            if swept and (new := re.search(r"add it with a '\+', \+([\w.]+)=VALUE$", line)):
                line += f" ('++{new.group(1)}=VALUE' where the yaml of some swept options sets it and others' not)"
            _fail(line + where(ovs))
        except ValueError as e:  # Hydra's own refusals of an override's form raise plain ValueErrors
            _fail(f"{' '.join(ovs)}: {first_line(e)}" + where(ovs))
        configs.append(cfg)
    grid = prod(len({p[i] for p in points}) for i in swept)
    if swept and grid == len(points):
        check_swept_keys_read(points, swept, configs)
        check_sweep_resume(points, swept, configs, overrides)
    if multirun and not all(str(c.resume) == "auto" for c in configs):
        check_sweep_leftovers(grid, overrides)
    if not printing:
        check_output_dir_kind(overrides, multirun)


def check_output_dir_kind(overrides: list[str], multirun: bool) -> None:
    """A single run reads ``hydra.run.dir`` only and a sweep ``hydra.sweep.dir`` only: the other
    one, given alone, was dropped without a word and the run went to ``outputs/`` or
    ``multirun/`` under the current folder."""
    given = {ov.lstrip("+").split("=", 1)[0] for ov in overrides}
    mine, other = ("hydra.sweep.dir", "hydra.run.dir") if multirun else ("hydra.run.dir", "hydra.sweep.dir")
    if other in given and mine not in given:
        value = next(ov.split("=", 1)[1] for ov in overrides if ov.lstrip("+").startswith(other + "="))
        _fail(f"{other} is the folder of a {'single run' if multirun else 'sweep (-m)'}, which this "
              f"{'sweep' if multirun else 'single run'} does not read: give {mine}={value}"
              + (f" (its points go to {value.rstrip('/')}/0, /1, ...)" if multirun
                 else ", or add -m to launch a sweep"))


def check_swept_keys_read(points: list[list[str]], swept: list[int], configs: list) -> None:
    """A swept key that no point of the sweep reads (optim.tau under optim=adamw, deescalate.lambda_
    without deescalate=block) is refused: each point would train the same model, and the sweep's
    table and figure would read as "it has no effect"."""
    from stabletrain.build import own_groups, unread_data_reasons
    from stabletrain.config import unread_reasons
    from stabletrain.models.registry import model_unread_reasons

    reasons = [{**model_unread_reasons(c.model), **unread_reasons(c, own_groups(c)), **unread_data_reasons(c)}
               for c in configs]
    for i in swept:
        key = points[0][i].split("=")[0].lstrip("+~")
        if all(key in r for r in reasons):
            values = ",".join(dict.fromkeys(p[i].split("=", 1)[1] for p in points))
            _fail(f"{key}={values} is swept, but no point of the sweep reads it: {reasons[0][key]}; no point was "
                  f"launched")


def check_sweep_resume(points: list[list[str]], swept: list[int], configs: list, overrides: list[str]) -> None:
    """``resume=auto`` in a sweep directory that holds runs continues point N from ``N/``, Hydra's
    number of the point's place in the grid: a value added inside a list moves the later points,
    which would then be refused one by one (their ``.hydra/`` rewritten with another point's values,
    which the sweep's table then shows beside the run's results) or trained again. Refused here,
    before any point starts, naming where each run went."""
    import yaml
    from omegaconf import OmegaConf

    given = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides if "=" in o}
    root = given.get("hydra.sweep.dir")
    if root is None or "hydra.sweep.subdir" in given or not all(str(c.resume) == "auto" for c in configs):
        return
    keys = [points[0][i].split("=")[0].lstrip("+~") for i in swept]

    def values(cfg) -> tuple:  # a group's choice (optim=adamw2) is its name in the config
        out = []
        for k in keys:
            v = OmegaConf.select(cfg, k)
            v = v.get("name", v.get("family")) if OmegaConf.is_config(v) else v
            out.append(_comparable(v))
        return tuple(out)

    wanted = [values(c) for c in configs]
    for num, want in enumerate(wanted):
        stored = Path(root) / str(num) / "config.yaml"
        if not stored.is_file():
            continue
        try:
            held = values(OmegaConf.create(yaml.safe_load(stored.read_text())))
        except Exception:  # noqa: BLE001 - a config of another version: the point's own resume check says it
            continue
        if held == want:
            continue
        run = ", ".join(f"{k}={v}" for k, v in zip(keys, held))
        now = ", ".join(f"{k}={v}" for k, v in zip(keys, want))
        moved = f" (now point {wanted.index(held)})" if held in wanted else ", which this sweep no longer has"
        _fail(f"resume=auto: the sweep's points moved: point {num} is now {now}, but {root}/{num}/ holds the run "
              f"of {run}{moved}; Hydra numbers a sweep's points by their place in the grid: add new values at the "
              f"end of a list, or run the new points in another hydra.sweep.dir; no point was launched")


def check_sweep_leftovers(size: int, overrides: list[str]) -> None:
    """A new sweep into a folder holding points of an earlier, larger one: each of its own points
    sets the earlier run in its folder aside, but ``N/`` past its last point stays, and the sweep's
    table counts that run as one of this sweep's. Refused, naming them."""
    given = {o.split("=", 1)[0].lstrip("+"): o.split("=", 1)[1] for o in overrides if "=" in o}
    root = given.get("hydra.sweep.dir", "").strip("'\"")
    if not root or "${" in root or "hydra.sweep.subdir" in given or not Path(root).is_dir():
        return
    stale = sorted(int(p.name) for p in Path(root).iterdir() if p.name.isdigit() and int(p.name) >= size
                   and ((p / "config.yaml").is_file() or (p / ".hydra").is_dir()))
    if stale:
        held = ", ".join(f"{root}/{n}/" for n in stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        _fail(f"hydra.sweep.dir={root} holds {held} of an earlier sweep, past this sweep's {size} point"
              f"{'s' * (size != 1)}: its table would count {'them' if len(stale) > 1 else 'it'} as this sweep's; "
              f"choose another hydra.sweep.dir, or move {'them' if len(stale) > 1 else 'it'} out; no point was "
              f"launched")


def _comparable(v):
    """A value as a sweep's override and a run's config.yaml both give it: 0 and 0.0 are one."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float)):
        return float(v)
    return str(getattr(v, "value", v))


# the groups whose ``name`` picks a registered option: a yaml of one of them without it builds the default
NAMED_GROUPS = ("norm", "attention", "init", "reparam", "optim", "schedule", "data", "deescalate")


def option_yaml(group: str, option: str, overrides: list[str]) -> Path | None:
    """The yaml file of ``group=option``: in configs/ or the first searchpath folder that has it."""
    return next((f for d in config_dirs(overrides) if (f := d / group / f"{option}.yaml").is_file()), None)


def check_option_names(overrides: list[str]) -> None:
    """An option's yaml that sets no ``name:`` keeps the group's default (optim=lion training
    AdamW²): refused, naming the file."""
    import yaml

    from stabletrain.errors import ConfigError

    for ov in overrides:
        group, _, options = ov.lstrip("+").partition("=")
        if group not in NAMED_GROUPS:
            continue
        for option in options.split(","):
            path = option_yaml(group, option, overrides)
            try:
                body = yaml.safe_load(path.read_text()) if path is not None else None
            except (OSError, yaml.YAMLError):
                continue  # Hydra says what is wrong with it
            if isinstance(body, dict) and "name" not in body and "defaults" not in body:
                raise ConfigError(f"{path} sets no name: (the registered option it builds), so {group}={option} "
                                  f"would build the default {group}; add name: {option}, or the name it registers")


def _named_in_yaml(error: str, overrides: list[str]) -> str:
    """Where an unknown option's name came from a yaml (norm=mine whose file says name: mien):
    that file, which the user did not type the name into."""
    m = re.match(r"([\w.]+)=(\S+) is not an option", error)
    if m is None:
        return ""
    key, name = m.groups()
    if f"{key}={name}" in (ov.lstrip("+~") for ov in overrides):
        return ""  # typed on the command line (model.act=silu): no yaml to blame
    group = key.split(".")[0]
    for ov in overrides:
        g, _, option = ov.lstrip("+").partition("=")
        if g == group and option != name:
            path = option_yaml(g, option, overrides)
            if path is not None:
                return f" ({path} sets {key.split('.', 1)[1] if '.' in key else 'name'}: {name})"
    return ""


def print_own_options(overrides: list[str]) -> None:
    """Hydra's --help lists the groups' options in configs/ only: the searchpath's are said first."""
    own = config_dirs(overrides)[1:]
    found = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for d in own if d.is_dir()
             for g in sorted(d.iterdir()) if g.is_dir()}
    if found:
        print(f"Options of your own (in {', '.join(map(str, own))}), beside the groups' below:")
        for group, names in found.items():
            print(f"  {group}: {', '.join(names)}")
        print()


def help_text(overrides: list[str]) -> str | None:
    """``--help``: Hydra's page (train.yaml's header, the groups and their options, the config,
    the footer), but the config holds only the keys this run reads: a GPT's page listed the ViT's
    patch_size and the Swin's depths, a run without AdamW² its tau. None where the config does not
    compose (:func:`check_overrides` then tells the mistake in one line)."""
    from omegaconf import OmegaConf

    from stabletrain.build import unread_data_reasons
    from stabletrain.config import unread_reasons
    from stabletrain.models.registry import model_unread_reasons

    try:
        cfg = compose_config(overrides, with_hydra=True)
        help_cfg = cfg.hydra.help
        cfg = OmegaConf.to_container(cfg, resolve=False)
    except Exception:  # noqa: BLE001 - a mistake in the overrides: told in one line after this
        return None
    del cfg["hydra"]
    chosen = OmegaConf.create(cfg)
    try:
        left_out = [*model_unread_reasons(chosen.model), *unread_reasons(chosen), *unread_data_reasons(chosen)]
    except Exception:  # noqa: BLE001 - a config of one's own the checks refuse in one line: its page is whole
        left_out = []
    for key in left_out:
        group, _, leaf = key.partition(".")
        (cfg[group] if leaf else cfg).pop(leaf or group, None)
    groups = {g: group_options(g, overrides) for g in sorted({p.name for d in config_dirs(overrides) if d.is_dir()
                                                              for p in d.iterdir() if p.is_dir()} - {"hydra"})}
    listing = "\n".join(f"{g}: {', '.join(opts)}" for g, opts in groups.items() if opts)
    return (f"{help_cfg.header}\n== Configuration groups ==\nCompose your configuration from those groups "
            f"(group=option)\n\n{listing}\n\n\n== Config ==\nOverride anything in the config (foo.bar=value). "
            f"Left out: the {len(left_out)} keys this run's choices do not read (--cfg job prints every key).\n\n"
            f"{OmegaConf.to_yaml(cfg)}\n{help_cfg.footer}")


def _adds_freely(name: str, overrides: list[str]) -> bool:
    """Whether ``+name=...`` may add a key the schema lacks: Hydra's, an own option's argument
    (``model.kwargs.X``), or a group (``+experiment=...``)."""
    return (name.startswith("hydra") or name.startswith(tuple(f"{g}.kwargs." for g in KWARGS_GROUPS))
            or is_group(name.split("/")[0], overrides))


def _composes_with(key: str, overrides: list[str]) -> bool:
    """Whether the config of ``overrides`` has ``key`` (a loss term's parameter too, which only
    its yaml declares); True where they do not compose, which the other checks then say."""
    from omegaconf import OmegaConf

    try:
        cfg = compose_config(overrides)
    except Exception:
        return True
    absent = object()
    return OmegaConf.select(cfg, key, default=absent, throw_on_missing=False) is not absent


def _parsed_value(ov: str):
    """The value of override ``ov`` as Hydra's grammar reads it (a dict for ``k={a:1}``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(ov).value()
    except Exception:
        return {}


def _added_key_hint(name: str, ov: str) -> str:
    """What to write instead of ``+name=...``, a key the schema lacks."""

    parts = name.split(".")
    kwargs = [f"{g}.kwargs" for g in KWARGS_GROUPS]
    if len(parts) > 2 and (near := difflib.get_close_matches(".".join(parts[:2]), kwargs, n=1, cutoff=0.8)):
        return f"did you mean +{near[0]}.{'.'.join(parts[2:])}?"  # +model.kwarg.depth
    near = _nearest_key(name)
    if near and near.startswith("did you mean"):
        return f"{near[:-1]} (without the '{ov[:len(ov) - len(ov.lstrip('+'))]}')?"
    return (f"{ov} adds a key nothing reads; drop the '+' to set an existing key "
            f"(`python train.py --cfg job` prints every key)")


def _without_cfg_flag(argv: list[str]) -> list[str]:
    """``argv`` without Hydra's ``--cfg job`` / ``-c all`` / ``--cfg=job`` (flag and value) and
    the ``--resolve`` that goes with it."""
    return [a for a in _take_flag(argv, ("--cfg", "-c"))[0] if a != "--resolve"]


def check_keys(overrides: list[str]) -> None:
    """``+key=value`` adds a key the schema does not have, which nothing would read: refused.
    ``+group=option`` (appending a config group, e.g. ``+experiment=...``) and Hydra's own keys pass."""
    import shutil

    from stabletrain.engine.rundir import RunDirLock
    from stabletrain.errors import ConfigError
    from stabletrain.topology import detect

    for ov in overrides:
        key = ov.split("=", 1)[0]
        group, value = key.lstrip("+~"), ov.partition("=")[2]
        nulls = "null" in (v.strip().lower() for v in value.split(","))  # a sweep's point too: norm=null,layernorm
        if "." not in group and nulls and is_group(group, overrides) and "~" not in key:
            options = group_options(group, overrides)
            raise ConfigError(f"{ov}: a group takes one of its options ({', '.join(options)})"
                              + ("; leave it out for no recipe (~experiment drops one a config of yours chose)"
                                 if group == "experiment" else f"; leave it out for the default, or choose {group}=none"
                                 if "none" in options else "; leave it out for the default"))
        if key.startswith("~") and not {".", "/"} & set(group) and group != "experiment" and is_group(group, overrides):
            # Hydra drops the group's yaml; the schema's defaults then train, without a word
            raise ConfigError(f"{ov}: removing the {group} group trains with the schema's own {group} settings; "
                              f"choose an option instead: {group}=" + "|".join(group_options(group, overrides)))
        if key.startswith("~") and group in schema_keys():
            # OmegaConf's own line: "OptimConfig (DictConfig) does not support deletion"
            raise ConfigError(f"{ov}: a key of the schema cannot be removed (every one is read); set it instead: "
                              f"{group}=VALUE")
        if group in (f"{g}.kwargs" for g in KWARGS_GROUPS) and value.lstrip().startswith("{") and \
                (entries := [f"+{group}.{k}={v}" for k, v in _parsed_value(ov).items()]):
            # the node is an empty struct dict: Hydra refused the dict's keys, the lines said to add a '+'
            raise ConfigError(f"{ov}: {group} takes its arguments one by one: {' '.join(entries)}")
        if key.startswith("++") and not _adds_freely(key[2:], overrides) and \
                not _composes_with(key[2:], [o for o in overrides if o != ov]):  # ++ sets a key, or adds one
            raise ConfigError(f"unknown key '{key[2:]}': {_added_key_hint(key[2:], ov)}")
        if key.startswith("+") and not key.startswith("++"):
            name = key.lstrip("+")
            if not _adds_freely(name, overrides):
                if _nearest_key(name) == f"did you mean {name}?":  # +norm.name=...: there already
                    raise ConfigError(f"{name} is a key of the config already: drop the '+' ({ov.lstrip('+')})")
                raise ConfigError(f"unknown key '{name}': {_added_key_hint(name, ov)}")
        if key.lstrip("+") in ("hydra.run.dir", "hydra.sweep.dir"):
            _check_output_dir(key.lstrip("+"), ov.split("=", 1)[1])
        if key.lstrip("+") == "hydra.run.dir" and "${" not in ov and detect().is_main:
            # the other ranks of this job start while rank 0 holds it
            RunDirLock(Path(ov.split("=", 1)[1].strip("'\""))).check_free()
        if key.lstrip("+") == "hydra.searchpath":
            missing = [str(d) for d in config_dirs([ov]) if not d.is_dir()]
            if missing:
                raise ConfigError(f"hydra.searchpath: {missing[0]} is not a folder; give file://DIR, DIR holding "
                                  f"one folder per group (model/, norm/, ...) with your options' yaml files")
        missing = [t for t in ("sbatch", "srun") if shutil.which(t) is None]  # submitit needs both
        if ov.startswith("hydra/launcher=slurm") and missing:
            raise ConfigError(f"hydra/launcher=slurm submits through SLURM, but there is no {' nor '.join(missing)} "
                              f"on this machine; run on the cluster's login node, or drop it to sweep locally")


def check_values(overrides: list[str]) -> None:
    """Values OmegaConf would take without a word for something else than meant: a number for a bool
    (``optim.nesterov=2`` read as true), and several options of one group (``optim=[adamw,sgd]``:
    Hydra merges both yaml files into one optim, the later's keys replacing the earlier's, so SGD
    trained with AdamW's leftovers; ``experiment=[a,b]`` one recipe over another). Only loss terms
    add up (``regularizer=[zloss,locater]``), each once. ``overrides``: one point of a sweep, with its
    hydra.searchpath (a group of one's own is a group there)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from stabletrain.config import is_bool_key
    from stabletrain.errors import ConfigError

    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_hydra_override() or o.is_sweep_override() or o.is_delete():
            continue
        key, value = o.key_or_group, o.value()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1) \
                and is_bool_key(key):
            raise ConfigError(f"{o.input_line.lstrip('+')}: {key} is true or false, e.g. {key}=true")
        if not isinstance(value, list) or "." in key or not is_group(key, overrides):
            continue
        names = [str(v) for v in value]
        twice = next((n for n in names if names.count(n) > 1), None)
        if key == "regularizer" and twice is not None:
            raise ConfigError(f"{o.input_line}: {twice} is listed twice, and a loss term is added once: "
                              f"{key}=[{','.join(dict.fromkeys(names))}] (its settings are regularizer.{twice}.*)")
        if key != "regularizer" and len(names) > 1:
            what = "recipes" if key == "experiment" else f"{key} options"
            raise ConfigError(f"{o.input_line}: {key} takes one option; a list merges the {what} into one, "
                              f"{names[-1]}'s values replacing {', '.join(names[:-1])}'s: choose one "
                              f"({key}={names[0]}), or with -m sweep them ({key}={','.join(names)})")


def _check_output_dir(key: str, value: str) -> None:
    """A run directory Hydra could not create (a file in its place or on its path, a folder
    without write permission) fails inside Hydra with a traceback: said here in one line."""
    import os

    from stabletrain.errors import ConfigError

    if "${" in value:  # interpolated (${now:...}): Hydra resolves it; nothing to check
        return
    if not value.strip("'\" "):  # Hydra would write the run's files straight into the current folder
        raise ConfigError(f"{key} is empty: give the run a folder of its own ({key}=runs/NAME)")
    path = Path(value.strip("'\"")).absolute()  # Hydra takes a quoted value without its quotes, and no ~
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is below {existing}, which is a file"
        raise ConfigError(f"{key}={value} {where}: a run directory must be a directory; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={value}: cannot write in {existing} (permission denied); choose another path")
    if key == "hydra.run.dir" and (path / "multirun.yaml").is_file():  # a run there mixes into the sweep's table
        raise ConfigError(f"{key}={value} is a sweep's folder (multirun.yaml): a point of it is {key}={value}/N "
                          f"(resume=auto continues it there), the whole sweep -m ... hydra.sweep.dir={value}")


def check_group_choices(cfg, overrides: list[str]) -> None:
    """A group chosen on the command line that a recipe then replaced (``experiment=X model=Y``,
    where X sets its own model) would train something else than asked: refused in one line."""
    from stabletrain.errors import ConfigError

    recipe = next((ov.split("=", 1)[1] for ov in overrides if ov.lstrip("+").startswith("experiment=")), None)
    if recipe is None:
        return
    import yaml

    def named(group: str, option: str) -> str:
        """The name an option's yaml gives (deescalate=ffn builds ``name: deescalate``), else its own."""
        path = option_yaml(group, option, overrides)
        try:
            body = yaml.safe_load(path.read_text()) if path is not None else None
        except (OSError, yaml.YAMLError):
            body = None
        return str(body["name"]) if isinstance(body, dict) and body.get("name") is not None else option

    for ov in overrides:
        group, _, option = ov.partition("=")
        node = cfg.get(group) if "." not in group and is_group(group, overrides) else None
        got = node.get("name") if node is not None and hasattr(node, "get") else None
        # (a recipe's option of the same name, deescalate=block for ffn, is not told apart)
        if got is not None and option in group_options(group, overrides) \
                and str(getattr(got, "value", got)) != named(group, option):
            raise ConfigError(f"experiment={recipe} sets its own {group} ({group}.name={got}), which replaces "
                              f"{group}={option}; change the recipe's {group} with {group}.KEY=VALUE overrides, "
                              f"or copy configs/experiment/{recipe}.yaml")


def _fail(msg: str) -> None:
    from stabletrain.errors import fail

    fail(msg)
