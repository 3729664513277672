"""What only a GPU run can show: resuming a ``device=cuda`` run, bf16 with torch.compile, the
AdamW² side stream, and SDPA's flash kernel. Skipped without a CUDA GPU (CI has none); the
logic each path shares with the CPU is tested there."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_loop import _run_until
from tests.helpers import QUIET, losses, make_cfg, model_of, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPT = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger.log_every=1", "device=cuda", "compile=false"]


@pytest.mark.parametrize("extra", [["optim=adamw2"], ["optim=adamw", "reparam=sigma", "ema.decay=0.9"]])
def test_a_cuda_run_resumes_where_it_stopped(tmp_path, extra):
    """The checkpoint's RNG states come back on the GPU; the generators take them on the CPU."""
    from stabletrain.build import build_trainer

    args = [*GPT, *extra, "steps=8", "precision=fp32"]
    train(tmp_path / "full", *args)
    _run_until(build_trainer(make_cfg(*QUIET, *args, "ckpt_every=4"), tmp_path / "half"), 4)
    assert train(tmp_path / "half", *args, "resume=auto")["status"] == "completed"
    full, half = losses(tmp_path / "full"), losses(tmp_path / "half")
    assert sorted(half) == sorted(full)
    assert all(half[k] == pytest.approx(full[k], rel=1e-5) for k in full)


def test_bf16_compiled_run_tracks_the_eager_run(tmp_path):
    args = [a for a in GPT if a != "compile=false"] + ["steps=6", "precision=bf16", "optim=adamw2"]
    train(tmp_path / "eager", *args, "compile=false")
    train(tmp_path / "compiled", *args)  # unset: compiled on a CUDA GPU
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert sorted(eager) == sorted(compiled)
    assert all(compiled[k] == pytest.approx(eager[k], rel=2e-2) for k in eager)


@pytest.mark.parametrize("fused", ["true", "false"])
def test_a_non_finite_step_is_skipped_with_cuda_weights_and_cpu_step_counters(tmp_path, fused):
    """Non-fused AdamW keeps its step counters on the CPU beside CUDA weights: the guard writes
    them back with a CPU copy of the device's flag."""
    args = [*GPT, "optim=adamw", f"optim.fused={fused}", "steps=6", "precision=fp32", "debug.nan_at_step=3"]
    summary = train(tmp_path / fused, *args)
    assert summary["status"] == "completed" and summary["skipped_steps"] == 1


def test_adamw2_side_stream_gives_the_inline_numbers(tmp_path):
    """optim.overlap_sigma_w iterates sigma1(W) on a CUDA side stream: the stream waits for
    the step that wrote W, and the next step waits for the stream."""
    args = [*GPT, "optim=adamw2", "optim.tau=0.002", "grad_clip=1.0", "steps=6", "precision=fp32"]
    train(tmp_path / "inline", *args)
    train(tmp_path / "overlap", *args, "optim.overlap_sigma_w=true")
    inline, overlap = losses(tmp_path / "inline"), losses(tmp_path / "overlap")
    assert all(overlap[k] == pytest.approx(inline[k], rel=1e-6) for k in inline)


@pytest.mark.parametrize("attention", ["softmax", "qknorm", "stable"])
def test_bf16_attention_runs_a_fused_sdpa_kernel(attention):
    """Every attention variant reaches SDPA with a layout its flash or memory-efficient kernel
    takes: no (T x T) score matrix is written."""
    from torch.profiler import ProfilerActivity, profile

    model = model_of(make_cfg("model=gpt_test", f"attention={attention}")).cuda()
    x = torch.randint(0, 256, (4, 32), device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.autocast("cuda", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    kernels = " ".join(e.key.lower() for e in prof.key_averages())
    assert "flash" in kernels or "efficient_attention" in kernels or "fmha" in kernels, kernels[:2000]
