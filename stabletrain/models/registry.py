"""Model families by name (``model.family``) -> built models, with init and reparametrisation applied."""

from __future__ import annotations

from dataclasses import fields

from torch import nn

from stabletrain.config import Components
from stabletrain.registry import Registry

# family -> ``(model_cfg, components) -> nn.Module``; each family module registers itself with
#   kind      "vision" (images -> class logits) or "text" (tokens -> next-token logits): required,
#             it decides which data sets fit and which task loss trains it
#   data      the data set ``data=auto`` picks (default: digits for vision, pytext for text)
#   check     ``(model_cfg, components)`` raising ConfigError before anything is built
#   flops     ``(model, model_cfg) -> training FLOPs of one sample``, for MFU (none: no MFU)
#   no_decay  parameter names (whole, or the dotted name's last part) kept out of weight decay;
#             none registered: the model's own ``no_weight_decay()`` if it has one (timm's)
#   keys      the ``model.*`` keys it reads; one of the others set away from its default is noted
#             as changing nothing (none registered: no note)
#   instead   ``{key: its own key}`` for a ``model.*`` key another family reads that this one sets
#             under another name (swin: depth -> depths, num_heads -> stage_heads): the note and
#             the type error of the other key name its counterpart
#   notes     ``model_cfg -> [start notes]`` on settings built otherwise than they read (swin: a
#             window larger than a stage's grid); none registered: no notes
#   tau       AdamW²'s bound where ``optim.tau`` is null (none registered: DEFAULT_TAU)
#   weights   ``(state, settings, model_cfg, model) -> (state, settings, [how read])`` reading a
#             checkpoint for ``init_weights``: another code base's names as the family's, its model
#             settings as ``model.*`` keys (gpt: nanoGPT's and Hugging Face's GPT-2), tensors of
#             another size resampled (vit, swin: timm's own filters); none: names as they are
MODELS = Registry("model.family", "stabletrain.models", package=True,
                  declares=("kind", "data", "check", "notes", "flops", "no_decay", "keys", "instead", "tau",
                            "weights"),
                  call="(model_cfg, components)",
                  returns=(lambda m: isinstance(m, nn.Module), "the model, an nn.Module"))
DEFAULT_TAU = 0.004  # 000 Table 2's ViT and Swin value
KINDS = {"vision": "digits", "text": "pytext"}  # each kind's default data set


def is_builtin(entry) -> bool:
    """Whether a registry entry is stabletrain's own (not registered by a module of ``imports``)."""
    return entry.fn.__module__.startswith("stabletrain.")


def family_tau(family: str | None) -> float:
    """AdamW²'s bound for ``optim.tau=null``: the family's (000 Table 2: 0.01 for GPT, 0.004 for
    ViT and Swin), DEFAULT_TAU for one registered without it or for None (a model of no family)."""
    return DEFAULT_TAU if family is None else float(MODELS.entry(family).info.get("tau", DEFAULT_TAU))


def family_entry(name):
    """The registry entry of model family ``name``, checked: a family registered outside
    stabletrain (``imports=...``) that forgot its ``kind`` is told so in one line."""
    from stabletrain.errors import ConfigError

    entry = MODELS.entry(name)
    if entry.info.get("kind") not in KINDS:
        raise ConfigError(f"model.family={entry.name} is registered without kind='vision' or kind='text': add it "
                          f"to its @MODELS.register(...)")
    return entry


def model_unread_reasons(model_cfg) -> dict[str, str]:
    """The ``model.*`` keys the model's family does not read (a GPT's patch_size), with the
    families that do; none for a family that declares no keys, or one not registered (a module
    of one's own not imported)."""
    from stabletrain.config import ModelConfig

    own = MODELS.entry(model_cfg.family).info.get("keys") if model_cfg.family in MODELS else None
    if own is None:
        return {}
    out = {}
    for key in (f.name for f in fields(ModelConfig) if f.name not in (*own, "name", "family", "kwargs")):
        readers = [n for n in MODELS.names() if key in MODELS.entry(n).info.get("keys", ())]
        out[f"model.{key}"] = (f"only model.family={'/'.join(readers)} reads it, and this run has "
                               f"model.family={model_cfg.family}"
                               + "".join(f"; its counterpart there is model.{own}"
                                         for _, own in counterparts(key, model_cfg.family)))
    return out


def counterparts(key: str, family: str | None = None) -> list[tuple[str, str]]:
    """``(family, its key)`` of the families that set ``model.<key>`` under a name of their own
    (``instead=``: swin's ``stage_heads`` for ``num_heads``); of ``family`` alone when given."""
    names = MODELS.names() if family is None else [family] if family in MODELS else []
    return [(n, MODELS.entry(n).info["instead"][key]) for n in names if key in MODELS.entry(n).info.get("instead", {})]


def unread_model_keys(model_cfg, given=()) -> list[str]:
    """One note per ``model.*`` key set away from its default, or ``given`` on the command line,
    that the family does not read (``model.dropout=0.1`` on a ViT), naming the families that do."""
    from stabletrain.config import ModelConfig, differs, shown_value

    default = ModelConfig()
    return [f"note: {key}={shown_value(model_cfg[key[6:]])} changes nothing: {why}"
            for key, why in model_unread_reasons(model_cfg).items()
            if key in given or differs(model_cfg[key[6:]], getattr(default, key[6:]))]


def build_model(model_cfg, components: Components | None = None) -> nn.Module:
    """The model ``model_cfg`` describes, built of ``components`` (defaults where None), then
    re-initialised per ``components.init`` and reparametrised per ``components.reparam``.

    Returns the model; its reparametrisation's per-step hook is ``model.step_hook`` (a no-op
    without one; see :func:`build_model_and_hook` for the pair, None there). A loop of one's own
    must call ``model.step_hook()`` after every optimizer step: sigmaReparam's ``sigma`` is
    otherwise never iterated past its first estimate."""
    model, hook = build_model_and_hook(model_cfg, components)
    model.step_hook = hook if hook is not None else _no_step_hook
    return model


def _no_step_hook() -> None:
    """No reparametrisation: nothing to iterate after a step (a loop may call it whatever the options)."""


def build_model_and_hook(model_cfg, components: Components | None = None):
    """``(model, hook)``: ``hook()`` (or None) must run after every optimizer step (sigmaReparam's
    power iteration)."""
    from stabletrain.layers.init import apply_init
    from stabletrain.layers.reparam import REPARAMS

    c = components or Components()
    check = MODELS.entry(model_cfg.family).info.get("check")
    if check is not None:  # the family's one-line refusals (build.validate runs them for train.py)
        check(model_cfg, c)
    model = MODELS.make(model_cfg.family, model_cfg, c)
    apply_init(model, c.init)
    return model, REPARAMS.make(c.reparam.name, model, c.reparam)


def transformer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` for every transformer block, in forward order.

    A block has ``norm1``, ``attn`` (qkv, proj, num_heads), ``norm2`` and ``mlp`` (fc1, fc2):
    true of every family's block here (:mod:`stabletrain.layers.block`).
    """
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "attn") and hasattr(m, "mlp") and hasattr(m, "norm1")]
