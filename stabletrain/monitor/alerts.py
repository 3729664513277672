"""Health alerts and crash forensics on top of the logged metrics (docs/methods.md §7).

Near-zero attention entropy alone is not a crash signal: healthy runs show a benign collapse
to a near-identity attention map with a spread-out ``W_q^T W_k`` spectrum (000).
The malignant collapse that precedes a crash has entropy near zero, a rapidly growing
``sigma1(W_q^T W_k)`` and its spectral energy in a few directions (000).
:class:`HealthWatch` alerts only when all three hold in the same block.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from stabletrain.monitor import names as N


@dataclass
class _BlockState:
    qk: list[tuple[int, float]] = field(default_factory=list)  # (step, sigma1) within the growth window
    entropy_min: float | None = None
    sec: dict[int, float] = field(default_factory=dict)  # s -> SEC(d_h, s)
    firing: bool = False
    # the steps the latest entropy and SEC were measured at (their passes run at other cadences)
    entropy_step: int | None = None
    sec_step: int | None = None
    below_since: int | None = None  # the first step of the present spell of entropy under the floor

    @classmethod
    def restore(cls, state: Mapping) -> _BlockState:
        """From ``asdict`` output (a checkpoint); keys of older versions are ignored."""
        known = {k: v for k, v in state.items() if k in cls.__dataclass_fields__}
        known["qk"] = [tuple(x) for x in known.get("qk", [])]
        known["sec"] = {int(k): v for k, v in known.get("sec", {}).items()}
        return cls(**known)


class HealthWatch:
    """Feed it each step's metrics; it returns the alerts that became true at that step.

    Malignant entropy collapse in block ``b`` (all three, on the latest value of each):

    1. ``entropy/<b>/min`` (min over heads) < ``entropy_floor`` nats;
    2. ``sigma1/<b>/wq_t_wk_max`` (max over heads) > ``qk_growth`` x its value ``qk_window``
       steps earlier (the oldest one logged in that window, or the one before the latest):
       growth since initialisation would not do, as healthy training multiplies it 1000-fold;
    3. **Decision:** spectral energy concentration ``SEC(d_h, s*) > sec_threshold`` with
       ``s* = names.sec_alert_size(d_h)`` (4 at ``d_h = 64``: the paper's ``SEC(64, 4) > 99%``,
       000). An absolute threshold rather than a rise, because the paper states the
       signature as a level and a rise from a random init's low SEC also happens in healthy
       training. ``d_h`` is read off the SEC curve (its last point is ``s = d_h``). In a
       block whose SEC is never logged, conditions 1 and 2 decide alone.

    Metrics arrive at different cadences (weights every ``weight_every`` steps, the probe
    every ``probe_every``), so each condition uses the latest value seen, and the message names
    the step of a value measured before the alert's. An alert fires once
    when the conditions become true in a block and re-arms when they stop holding.
    Each alert is ``dict(step, layer, quantity, value, onset, message)``, ``onset`` the step the
    collapse began at (:meth:`_onset`), where a rollback must go back before.
    """

    def __init__(self, entropy_floor: float = 0.1, qk_growth: float = 10.0,
                 sec_threshold: float = 0.99, qk_window: int = 1000):
        self.entropy_floor = entropy_floor
        self.qk_growth = qk_growth
        self.qk_window = qk_window
        self.sec_threshold = sec_threshold
        self.blocks: dict[str, _BlockState] = {}

    @classmethod
    def from_config(cls, monitor_cfg) -> HealthWatch:
        """From ``MonitorConfig`` (``entropy_floor``, ``qk_growth``, ``qk_window``)."""
        return cls(entropy_floor=monitor_cfg.entropy_floor, qk_growth=monitor_cfg.qk_growth,
                   qk_window=monitor_cfg.qk_window)

    def update(self, step: int, metrics: Mapping[str, float]) -> list[dict]:
        touched = set()
        for name, value in metrics.items():
            p = N.parse(name)
            if p is None or not _finite(value):
                continue
            st = self.blocks.setdefault(p.block, _BlockState())
            if p.group == N.SIGMA1 and p.quantity == N.WQ_T_WK_MAX:
                if value <= 0:
                    continue
                st.qk.append((step, float(value)))
                while len(st.qk) > 2 and st.qk[1][0] <= step - self.qk_window:
                    st.qk.pop(0)  # the oldest entry left is the latest one at least a window back
            elif p.group == N.ENTROPY and p.quantity == N.ENT_MIN:
                st.entropy_min, st.entropy_step = float(value), step
                below = st.entropy_min < self.entropy_floor
                st.below_since = (st.below_since if st.below_since is not None else step) if below else None
            elif p.group == N.SEC and p.quantity and p.quantity[1:].isdigit():
                st.sec[int(p.quantity[1:])], st.sec_step = float(value), step
            else:
                continue
            touched.add(p.block)
        alerts = []
        for block in N.natural_sorted(touched):
            st = self.blocks[block]
            verdict = self._malignant(st, step)
            if verdict is None:
                st.firing = False
            elif not st.firing:
                st.firing = True
                alerts.append({
                    "step": step, "layer": block, "quantity": N.metric(N.ENTROPY, block, N.ENT_MIN),
                    "value": st.entropy_min, "onset": self._onset(st),
                    "message": f"step {step}: malignant entropy collapse at {block}: {verdict}",
                })
        return alerts

    def _onset(self, st: _BlockState) -> int | None:
        """Where the collapse began: the first step of its spell of entropy under the floor, or the
        first logged step of sigma1's growth past ``qk_growth`` x its reference, the earlier. A
        rollback goes to a checkpoint before it: one from inside the collapse restores it."""
        ref = st.qk[0][1] if st.qk else None
        grown = next((s for s, v in st.qk if ref and v > self.qk_growth * ref), None)
        known = [s for s in (st.below_since, grown) if s is not None]
        return min(known) if known else None

    def _malignant(self, st: _BlockState, now: int | None = None) -> str | None:
        """The reason string when the three conditions hold, else None; a value measured at
        another step than ``now`` (each pass has its own cadence) says its step."""
        def at(step: int | None) -> str:
            return f" (at step {step})" if step is not None and now is not None and step != now else ""

        if st.entropy_min is None or st.entropy_min >= self.entropy_floor:
            return None
        if len(st.qk) < 2:
            return None
        (first_step, first), (last_step, last) = st.qk[0], st.qk[-1]
        growth = last / first
        if growth <= self.qk_growth:
            return None
        reason = (f"min attention entropy {st.entropy_min:.3g}{at(st.entropy_step)} < {self.entropy_floor:g} nats, "
                  f"max sigma1(Wq^h^T Wk^h) {last:.4g}{at(last_step)} = {growth:.1f}x its value at step {first_step}")
        if st.sec:
            d_h = max(st.sec)
            s = N.sec_alert_size(d_h)
            if s not in st.sec or st.sec[s] <= self.sec_threshold:
                return None
            reason += f", SEC({d_h},{s}) = {st.sec[s]:.4f}{at(st.sec_step)} > {self.sec_threshold:g}"
        return reason


def _finite(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


_GROWTH_LABELS = {
    N.WQ_T_WK_MAX: "max sigma1(Wq^T Wk)",
    N.WQ_T_WK_MEAN: "mean sigma1(Wq^T Wk)",
    N.WQ_T_WK_FULL: "full-width sigma1(Wq^T Wk)",
    N.WO_WV_MAX: "max sigma1(Wo Wv)",
    N.WO_WV_FULL: "full-width sigma1(Wo Wv)",
    N.W2_W1: "sigma1(W2 W1)",
}


def growth_summary(history: Iterable[Mapping], quantity: str = N.WQ_T_WK_MAX,
                   group: str = N.SIGMA1, window: int | None = 200) -> str | None:
    """Crash forensics: the block where ``group/<block>/quantity`` grew the most, as a sentence.

    ``history`` is a sequence of snapshots (``metrics.jsonl`` lines: ``step`` plus any
    metrics). Growth is the last finite value over the value at the start of the last
    ``window`` steps (the whole history when ``window`` is None), e.g. ``"max sigma1(Wq^T
    Wk) grew 40x in 200 steps at blocks.3 (31.2 at step 800 -> 1250 at step 1000)"``.
    Returns None when the quantity was never logged.
    """
    series: dict[str, list[tuple[int, float]]] = {}
    for snap in history:
        step = snap.get("step")
        for name, value in snap.items():
            p = N.parse(name)
            if p and p.group == group and p.quantity == quantity and _finite(value) and step is not None:
                series.setdefault(p.block, []).append((int(step), float(value)))
    best = None
    for block, pts in series.items():
        pts.sort()
        last_step, last = pts[-1]
        start = last_step - window if window is not None else pts[0][0]
        first_step, first = next((s, v) for s, v in pts if s >= start)
        if first <= 0 or first_step == last_step:  # one snapshot says nothing of growth
            continue
        ratio = last / first
        if best is None or ratio > best[0]:
            best = (ratio, block, first_step, first, last_step, last)
    if best is None:
        return None
    ratio, block, s0, v0, s1, v1 = best
    label = _GROWTH_LABELS.get(quantity, f"{group}/{quantity}")
    times = f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2g}x"
    return (f"{label} grew {times} in {s1 - s0} steps at {block} "
            f"({v0:.4g} at step {s0} -> {v1:.4g} at step {s1})")


def _nonfinite(obj) -> bool:
    """Whether any floating tensor inside (tuples, lists, dicts) has a NaN or Inf."""
    if isinstance(obj, Tensor):
        return obj.is_floating_point() and not bool(torch.isfinite(obj).all())
    if isinstance(obj, (list, tuple)):
        return any(_nonfinite(o) for o in obj)
    if isinstance(obj, Mapping):
        return any(_nonfinite(o) for o in obj.values())
    return False


INPUT = "(input)"
ROOT = "(model)"


def first_nonfinite(model: nn.Module, batch_fn: Callable[[nn.Module], object]) -> str | None:
    """Crash forensics: the module where a NaN/Inf first appears in a forward pass.

    Installs forward pre- and post-hooks on every submodule, runs ``batch_fn(model)`` (which
    should run the forward pass on the offending batch) under ``no_grad``, removes the hooks
    and returns a module name such as ``"blocks.3.attn.proj"``:

    - the first module, in completion order, whose output is non-finite while its inputs
      were finite - a leaf that produced it, or a parent whose own code did;
    - if a module is entered with non-finite positional inputs that no earlier module
      output, the value came from its parent's own code (e.g. an SDPA call between child
      modules), and the parent is named;
    - ``"(input)"`` when the batch itself is non-finite, ``"(model)"`` for the top module's
      own code, None when every module output is finite (the loss function then is the
      culprit). Keyword arguments of modules are not inspected.

    Pass the unwrapped model (not DDP or ``torch.compile``). Training/eval mode is left as is.
    """
    found: list[str] = []
    stack: list[str] = []
    handles = []

    def label(name: str) -> str:
        return name or ROOT

    def pre(name):
        def hook(_mod, args):
            if not found and _nonfinite(args):
                found.append(label(stack[-1]) if stack else INPUT)
            stack.append(name)
        return hook

    def post(name):
        def hook(_mod, _args, output):
            stack.pop()
            if not found and _nonfinite(output):
                found.append(label(name))
        return hook

    try:
        for name, mod in model.named_modules():
            handles.append(mod.register_forward_pre_hook(pre(name)))
            handles.append(mod.register_forward_hook(post(name)))
        with torch.no_grad():
            batch_fn(model)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None
