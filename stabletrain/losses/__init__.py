"""Loss terms added to the task loss, chosen by name (``regularizer=...``), several at once.

A term sees the batch, the model's output logits and the model, so a weight penalty
(LocAteR) and a logit penalty (z-loss) plug in the same way. Each is one module here that
registers a parameter dataclass and a class built from it::

    @dataclass
    class ZLossParams:
        coef: float = 1e-4

    @LOSS_TERMS.register("zloss", params=ZLossParams)
    class ZLoss:
        def __init__(self, p: ZLossParams): ...
        def __call__(self, model, logits, x, y) -> Tensor: ...   # a 0-dim tensor with grad

and one yaml, ``configs/regularizer/zloss.yaml`` (``zloss: {coef: 1e-4}``). The config holds
``regularizer: {name: params}``; ``regularizer=[locater,zloss]`` selects both, and
``regularizer.zloss.coef=1e-3`` sets a parameter. Parameters are checked against the
dataclass (a misspelt key or a wrong type is one line) and by its ``__post_init__``.

A term that reads weights declares it (``register(..., reads_weights=True)``; the built term
has ``reads_weights``): outside the forward, FSDP2's weights are this rank's shards, so under
``parallel=fsdp`` the trainer calls it with ``whole_weights=`` a function ``(module, fn) ->
fn(module)`` that computes on the module's whole weights, and the term reads every weight
through it, a module at a time (:func:`stabletrain.layers.locater.locater_penalty`); without
sharding the keyword is not passed.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from omegaconf import OmegaConf

from stabletrain.errors import ConfigError
from stabletrain.registry import Registry

LOSS_TERMS = Registry("regularizer", __name__, package=True, declares=("params", "reads_weights"),
                      requires={"params": "the dataclass of the term's parameters; an empty @dataclass for none"})

LossTerm = Callable[..., Any]  # (model, logits, x, y) -> 0-dim tensor; has a ``name``


def term_params(name: str, given: Mapping | None):
    """``given`` checked against term ``name``'s parameter dataclass, as an instance of it."""
    schema = LOSS_TERMS.entry(name).info["params"]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), given or {})
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0]
        key = getattr(e, "full_key", None) or ""
        wrong = (re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", first)
                 or re.match(r"Value '(.*)' is not a valid (bool)", first))
        missing = re.search(r"missing mandatory value: (\w+)", first)
        if wrong and key:
            kind = {"float": "a number", "integer": "an integer", "bool": "true or false"}.get(
                wrong.group(2).lower(), f"a {wrong.group(2).lower()}")
            default = getattr(schema, "__dataclass_fields__", {}).get(key)
            example = default.default if default is not None and isinstance(default.default, (int, float)) else None
            example = str(example).lower() if isinstance(example, bool) else example  # as a yaml writes it
            raise ConfigError(f"regularizer.{name}.{key}={wrong.group(1)} must be {kind}"
                              + (f", e.g. regularizer.{name}.{key}={example}" if example is not None else "")) from None
        if missing:
            raise ConfigError(f"regularizer.{name}.{missing.group(1)} has no default: set it, "
                              f"regularizer.{name}.{missing.group(1)}=VALUE") from None
        raise ConfigError(f"regularizer.{name}: {first} (its keys: "
                          f"{', '.join(schema.__dataclass_fields__)})") from None


def build_loss_terms(spec: Mapping[str, Any] | None) -> list[LossTerm]:
    """The terms of ``spec`` (``regularizer``: name -> parameters), in its order."""
    terms = []
    for name, given in (spec or {}).items():
        term = LOSS_TERMS.get(name)(term_params(name, given))
        term.name = name
        term.reads_weights = bool(LOSS_TERMS.entry(name).info.get("reads_weights"))
        terms.append(term)
    return terms
