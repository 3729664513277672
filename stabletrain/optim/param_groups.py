"""Which parameters decay, which AdamW² bounds, which LARS adapts (docs/methods.md §1, 8.3).

Every trainable parameter gets a role:

- ``gamma``: sigmaReparam's scale (name ends in ``gamma`` under a ``parametrizations`` path).
  Never decays, never bounded, LARS-excluded, ``lr_mult`` =
  ``reparam.gamma_lr_mult`` (docs/methods.md §2).
- ``norm_gain``: a ``*weight`` vector of a norm layer (every type a ``norm`` option registers,
  e.g. StableNorm, and torch's own: :func:`stabletrain.layers.norm.is_norm_layer`). No decay; bounded by AdamW²
  when ``bound_norm_gains`` (docs/methods.md decision: App. M plots RMSNorm gains hitting the bound).
- ``vector``: any other tensor with < 2 dims (biases, norm biases). No decay, unbounded.
- ``position``: the names a model family registers as ``no_decay`` (ViT: ``pos_embed``,
  ``cls_token``, timm's ``dist_token``, ``reg_token``; Swin: ``absolute_pos_embed``,
  ``relative_position_bias_table``; GPT: none), a whole dotted name or its last part; a family
  that registers none (one of the user's own) gets its model's ``no_weight_decay()`` (timm's).
  No decay (timm's recipe); bounded when a matrix after ``as_matrix`` (``pos_embed`` yes,
  ``cls_token`` no), as every matrix is.
- ``matrix``: everything else (>= 2 dims: linear and conv weights, embeddings). Decays,
  bounded. The GPT family decays every >= 2-D tensor incl. embeddings (nanoGPT).

LARS excludes (plain momentum, no decay) gamma, norm gains, every tensor of < 2 dims (biases)
and the ``position`` tensors that are vectors after ``as_matrix`` (``cls_token``). A ``matrix``
is adapted whatever its shape: a ``(1, 1, d)`` token of a family that registers no ``no_decay``
is decayed, adapted and left unbounded (a vector after ``as_matrix``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from torch import nn

from stabletrain.layers.norm import is_norm_layer
from stabletrain.metrics import param_count
from stabletrain.spectral import matrix_shape


@dataclass(frozen=True)
class ParamRole:
    kind: str  # gamma | norm_gain | vector | position | matrix
    decay: bool
    bound: bool
    lars_exclude: bool
    lr_mult: float


def _norm_gain_ids(model: nn.Module) -> set[int]:
    ids = set()
    for module in model.modules():
        if is_norm_layer(module):
            for local, p in module.named_parameters(recurse=False):
                if local.endswith("weight") and len(matrix_shape(p.shape)) <= 1:
                    ids.add(id(p))
    return ids


def classify(
    model: nn.Module, family: str | None, *, bound_norm_gains: bool = True, gamma_lr_mult: float = 1.0
) -> list[tuple[str, nn.Parameter, ParamRole]]:
    """``(name, param, role)`` for every trainable parameter, in ``named_parameters`` order.
    ``family`` None: a model of no registered family, grouped as one that registers no ``no_decay``."""
    from stabletrain.layers.reparam import gamma_parameters
    from stabletrain.models.registry import MODELS

    # an unknown family: one line; None (a module of one's own, no family): as a family registering none
    no_decay = MODELS.entry(family).info.get("no_decay") if family is not None else None
    if no_decay is None:  # a family of the user's own that registers none: timm's convention, if it has it
        no_decay = model.no_weight_decay() if callable(getattr(model, "no_weight_decay", None)) else ()
    no_decay = frozenset(no_decay)

    norm_gains = _norm_gain_ids(model)
    gammas = {id(p) for _, p in gamma_parameters(model)}
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = len(matrix_shape(p.shape)) >= 2
        if id(p) in gammas:
            role = ParamRole("gamma", decay=False, bound=False, lars_exclude=True, lr_mult=gamma_lr_mult)
        elif id(p) in norm_gains:
            role = ParamRole("norm_gain", decay=False, bound=bound_norm_gains, lars_exclude=True, lr_mult=1.0)
        elif p.dim() < 2:
            role = ParamRole("vector", decay=False, bound=False, lars_exclude=True, lr_mult=1.0)
        elif name in no_decay or name.split(".")[-1] in no_decay:
            role = ParamRole("position", decay=False, bound=is_matrix, lars_exclude=not is_matrix, lr_mult=1.0)
        else:
            role = ParamRole("matrix", decay=True, bound=is_matrix, lars_exclude=False, lr_mult=1.0)
        out.append((name, p, role))
    return out


def make_param_groups(
    model: nn.Module,
    family: str | None,
    weight_decay: float,
    *,
    optimizer: str = "adamw",
    bound_norm_gains: bool = True,
    gamma_lr_mult: float = 1.0,
) -> list[dict]:
    """Param groups for ``optimizer`` (adamw | adamw2 | lars | sgd), merged by what differs.

    Each group has ``params``, ``names``, ``weight_decay`` (``weight_decay`` or 0), ``lr_mult``,
    plus ``bound`` for adamw2 and ``lars_exclude`` for lars. ``lr`` is left to the caller.
    """
    from stabletrain.optim import OPTIMIZERS

    flag = OPTIMIZERS.entry(optimizer).info.get("group_flag")  # the one the optimizer reads per group
    groups: OrderedDict[tuple, dict] = OrderedDict()
    for name, p, role in classify(model, family, bound_norm_gains=bound_norm_gains, gamma_lr_mult=gamma_lr_mult):
        key: tuple = (role.decay, role.lr_mult)
        extra: dict = {}
        if flag is not None:
            key += (getattr(role, flag),)
            extra[flag] = getattr(role, flag)
        if key not in groups:
            groups[key] = dict(
                params=[],
                names=[],
                kinds=[],
                weight_decay=weight_decay if role.decay else 0.0,
                wd_mult=1.0 if role.decay else 0.0,  # set_weight_decay's mask for scheduled decay
                lr_mult=role.lr_mult,
                **extra,
            )
        groups[key]["params"].append(p)
        groups[key]["names"].append(name)
        groups[key]["kinds"].append(role.kind)
    return list(groups.values())


def summarize_groups(groups: list[dict], header: str = "", tau: float | None = None) -> str:
    """A few lines: per group its flags, tensor count, parameter count and example names; AdamW²'s
    ``tau`` in the words that say what "bound" means."""
    total_t = sum(len(g["params"]) for g in groups)
    total_n = sum(p.numel() for g in groups for p in g["params"])
    key = ""
    if any("bound" in g for g in groups):  # AdamW²'s word for it, said once
        at_most = f"tau={tau:g}" if tau is not None else "tau"
        key = f" (bound: each update's spectral norm at most {at_most} x sigma1(W); free: plain AdamW)"
    lines = [f"{header}{total_t} tensors, {param_count(total_n)} params in {len(groups)} groups{key}"]
    for g in groups:
        # wd_mult: a group that decays on a schedule (optim.weight_decay_end) may start at wd 0
        flags = ["decay" if g["weight_decay"] > 0 or g.get("wd_mult", 0) > 0 else "no-decay"]
        if "bound" in g:
            flags.append("bound" if g["bound"] else "free")
        if "lars_exclude" in g:
            flags.append("plain-sgd" if g["lars_exclude"] else "lars")
        if g.get("lr_mult", 1.0) != 1.0:
            flags.append(f"lr x{g['lr_mult']:g}")
        kinds = sorted(set(g.get("kinds", [])))
        n = sum(p.numel() for p in g["params"])
        examples = ", ".join(g["names"][:3]) + (", ..." if len(g["names"]) > 3 else "")
        lines.append(
            f"  {' '.join(flags):<24} wd {g['weight_decay']:<6g} {len(g['params']):>4} tensors "
            f"{param_count(n):>8}  [{'/'.join(kinds)}] {examples}"
        )
    return "\n".join(lines)


def parameter_table(model: nn.Module, depth: int = 2) -> str:
    """Parameters per module path (down to ``depth`` dots; a stack of equal blocks as one row)."""
    import re

    rows: OrderedDict[str, list[int]] = OrderedDict()
    for name, p in model.named_parameters():
        key = re.sub(r"\.\d+(?=\.|$)", ".*", ".".join(name.split(".")[:depth]))
        row = rows.setdefault(key, [0, 0])
        row[0], row[1] = row[0] + 1, row[1] + p.numel()
    total = sum(p.numel() for p in model.parameters())
    width = max(len(k) for k in rows) if rows else 10
    lines = [f"{'module':<{width}}  tensors  params"]
    lines += [f"{k:<{width}}  {t:>7}  {param_count(n):>8}" for k, (t, n) in rows.items()]
    lines.append(f"{'total':<{width}}  {sum(t for t, _ in rows.values()):>7}  {param_count(total):>8} ({total:,})")
    return "\n".join(lines)
