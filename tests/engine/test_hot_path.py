"""The training step's hot path, as far as a CPU can check it: ``compile=true`` traces every
component in one graph, trains the eager run's numbers and generates the kernels of a bare
compiled loop, and no step waits for the device except the log, evaluation and checkpoint steps.

A host sync cannot be timed on a CPU, but it can be seen: every way a tensor's value reaches
Python (``.item()``, ``.tolist()``, ``bool``, ``float``, ``.cpu()``) goes through
``__torch_function__``, so a function mode records them with the step they happened in.
"""

from __future__ import annotations

import collections
import shutil
import traceback

import pytest
import torch
import torch._dynamo
from torch.overrides import TorchFunctionMode

from stabletrain.build import build_trainer
from stabletrain.config import Components
from stabletrain.engine.sharding import apply_activation_checkpointing
from stabletrain.models.registry import build_model, transformer_blocks
from tests.helpers import QUIET, has_cpp_compiler, losses, make_cfg, train
from tests.layers.helpers import make_cfg as component_cfg
from tests.layers.helpers import model_input

# Each case combines one option of every component group; together they cover every option.
COMPONENTS = [
    {},
    dict(attention=dict(name="qknorm"), reparam=dict(name="sigma"), norm=dict(name="stablenorm", alpha=0.25),
         deescalate=dict(name="deescalate", placement="block"), init=dict(name="xavier")),
    dict(attention=dict(name="stable"), reparam=dict(name="sigma", apply_to="qk"),
         norm=dict(name="rmsnorm", placement="post"), deescalate=dict(name="deescalate", placement="ffn"),
         init=dict(name="stable")),
]


@pytest.mark.parametrize("case", [*range(len(COMPONENTS)), "checkpointed"])
@pytest.mark.parametrize("model_name", ["vit_test", "swin_test", "gpt_test"])
def test_every_component_compiles_to_one_graph(model_name, case):
    """``fullgraph=True`` fails on any graph break; AOT autograd (the backward inductor would
    compile) must give eager's loss and gradients. ``checkpointed``: sigmaReparam blocks under
    ``activation_checkpointing=true``."""
    checkpointed = case == "checkpointed"
    cfg = component_cfg(model_name, **(dict(reparam=dict(name="sigma")) if checkpointed else COMPONENTS[case]))
    torch.manual_seed(0)
    model = build_model(cfg.model, Components.of(cfg)).train()
    if checkpointed:
        apply_activation_checkpointing(transformer_blocks(model))
    x = model_input(cfg, batch=2, tokens=8, seed=0)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    grads = []
    for m in (model, compiled):
        torch.manual_seed(1)  # the same dropout / drop-path draws
        loss = m(x).float().square().mean()
        grads.append([loss, *torch.autograd.grad(loss, list(model.parameters()))])
    for eager, traced in zip(*grads):
        torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not has_cpp_compiler(), reason="inductor needs a C++ compiler on the CPU")
@pytest.mark.parametrize("extra", [
    ["model=gpt_test", "optim=adamw2", "reparam=sigma", "ema.decay=0.9", "regularizer=[zloss,locater]",
     "monitor=standard", "monitor.weight_every=2", "monitor.probe_every=2"],
    ["model=vit_test", "optim=adamw", "data.mixup=0.8", "data.label_smoothing=0.1", "grad_clip=1.0"],
])
def test_compiled_run_trains_the_eager_run(tmp_path, extra):
    """``compile=true`` (inductor, the model and the loss): the eager run's losses, two graphs
    (the model and the loss), no graph break, and no recompilation over steps, schedule changes,
    evaluations, a weight average, the monitors' probe passes (on the same modules) and checkpoints."""
    args = [*extra, "batch_size=8", "steps=6", "eval_every=3", "ckpt_every=3", "logger.log_every=1"]
    eager = train(tmp_path / "eager", *args)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = train(tmp_path / "compiled", *args, "compile=true")
    assert compiled["status"] == eager["status"] == "completed"
    want, got = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    for key, value in eager["final"].items():
        assert compiled["final"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


@pytest.mark.skipif(not has_cpp_compiler(), reason="inductor needs a C++ compiler on the CPU")
@pytest.mark.parametrize("model_name", ["gpt_test", "vit_test"])
def test_compiled_step_generates_the_kernels_of_a_bare_loop(tmp_path, model_name):
    """The trainer compiles the model and its objective as two functions; a nanoGPT / timm loop
    compiles model and cross-entropy as one. Forward and backward, inductor must generate as many
    kernels for the trainer's step as for the bare loop's: no device work of the framework's
    hides inside the compiled graphs, and splitting them costs no fusion. In bf16 autocast, as on
    a GPU: the trainer's objective runs outside autocast, the bare loop's cast is inside."""
    import torch.nn.functional as F
    from torch._inductor import config as inductor_config
    from torch._inductor import metrics

    cfg = make_cfg(*QUIET, f"model={model_name}", "optim=adamw", "batch_size=8", "monitor=off", "compile=true",
                   "precision=bf16")
    trainer = build_trainer(cfg, tmp_path)
    batch = [trainer._to_device(x, y) for x, y in next(trainer.data.train_iter(0, trainer.shard))]
    raw = trainer.model

    def bare(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = raw(x)
        return F.cross_entropy(out.float().flatten(0, -2), y.flatten())

    counts = []
    with inductor_config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        for step in (lambda: trainer.train_step(batch, False),
                     lambda: [torch.compile(bare)(x, y).backward() for x, y in batch]):
            torch._dynamo.reset()
            metrics.reset()
            step()
            counts.append(metrics.generated_kernel_count)
    assert counts[0] == counts[1] > 0, f"trainer {counts[0]} kernels, bare loop {counts[1]}"


SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero}


class SyncRecorder(TorchFunctionMode):
    """``{step: [(function, where)]}`` of every tensor value read by Python, by the trainer's step.

    The data pipeline's index tensors live on the host by design (stabletrain/data): not counted."""

    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer
        self.seen: dict[int, list] = collections.defaultdict(list)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            ours = [f for f in traceback.extract_stack()[:-1] if "/stabletrain/" in f.filename]
            where = ours[-1].filename.split("/stabletrain/")[-1] + f":{ours[-1].lineno}" if ours else "?"
            if not where.startswith("data/"):
                self.seen[self.trainer.step].append((func.__name__, where))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("extra", [
    ["model=gpt_test", "optim=adamw2", "reparam=sigma", "ema.decay=0.9", "regularizer=zloss"],
    ["model=vit_test", "optim=adamw", "data.mixup=0.8", "grad_clip=1.0", "ema.decay=0.9"],
    ["model=gpt_test", "optim=lars", "divergence.skip_nonfinite=true"],
])
def test_no_step_waits_for_the_device_between_log_steps(tmp_path, extra):
    """Only the log steps (the interval's losses, skip flags and gradient norm: one read), the evaluations (one read per
    scored model) and the checkpoints (the finiteness check) read a tensor's value. Skipping
    non-finite steps (the default) and the weight average read nothing."""
    cfg = make_cfg(*QUIET, *extra, "batch_size=8", "steps=12", "logger.log_every=4", "eval_every=6",
                   "ckpt_every=6", "monitor=off")
    trainer = build_trainer(cfg, tmp_path)
    with SyncRecorder(trainer) as rec:
        trainer.fit()
    assert trainer.step == 12
    quiet_steps = set(range(1, 12)) - {4, 6, 8}
    assert not {s: rec.seen[s] for s in quiet_steps if rec.seen.get(s)}
    # step 6 evaluates (20 batches per scored model) and logs and saves: a read per scored model
    # (val, and val_ema with ema.decay) besides the log step's and the checkpoint's
    scored = 2 if "ema.decay=0.9" in extra else 1
    assert len([w for _, w in rec.seen[6] if w.startswith("engine/")]) == scored + 2, rec.seen[6]


def test_compile_without_its_compiler_is_one_line(monkeypatch):
    import importlib.util

    from stabletrain.build import check_compiler
    from stabletrain.errors import ConfigError

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"^compile=true on a CPU .* no C\+\+ compiler .* set compile=false$"):
        check_compiler(torch.device("cpu"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^compile=true on CUDA needs triton.*set compile=false$"):
        check_compiler(torch.device("cuda"))


def test_compile_unset_is_on_for_a_cuda_gpu_with_triton_and_off_on_a_cpu(monkeypatch):
    import importlib.util

    from stabletrain.build import resolve_compile
    from stabletrain.errors import ConfigError

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # triton is there
    assert resolve_compile(None, cuda) is True and resolve_compile(None, cpu) is False
    assert resolve_compile(False, cuda) is False
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert resolve_compile(None, cuda) is False  # unset: eager without triton, no error
    with pytest.raises(ConfigError, match="compile=true on CUDA needs triton"):
        resolve_compile(True, cuda)  # asked for: the missing piece is named
