"""The benchmark and reproduction scripts still run (tiny CPU settings); timings are not judged."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from tests.helpers import ROOT


def script(name: str, *args: str, timeout: int = 300) -> str:
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, "WANDB_MODE": "disabled"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def rows(out: str, first: str) -> list[list[str]]:
    """Cells of the markdown table rows whose first cell starts with ``first``."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith(f"| {first}")]


def positive(cell: str) -> bool:
    return float(cell) > 0


@pytest.mark.parametrize("mode", [[], ["--optimizer-only", "--skip-power"],
                                  ["--optims", "adamw,adamw2-overlap", "--accum", "2", "--skip-power"]])
def test_bench_optim(mode):
    out = script("bench_optim.py", "--device", "cpu", "--tiny", "--steps", "2", "--warmup", "1", *mode)
    variants = mode[mode.index("--optims") + 1].split(",") if "--optims" in mode else ["adamw", "adamw2"]
    for model in ("ViT-tiny", "GPT-tiny"):
        table = {r[1]: r for r in rows(out, model)}
        assert set(table) == set(variants)
        assert all(positive(table[v][2]) for v in table)
    if not mode:
        assert positive(rows(out, "batched by shape")[0][1])
        assert re.search(r"bound \d\.\d\d", out)  # AdamW²'s telemetry reached the table


def test_bench_train(tmp_path):
    out = script("bench_train.py", "--models", "vit_test,gpt_test", "--device", "cpu", "--batch", "4", "--seq",
                 "32", "--steps", "2", "--warmup", "1", "--eager", "--variants", "adamw2", "--profile", "adamw2",
                 "--out", str(tmp_path))
    assert len(rows(out, "bare |")) == 2 and "vit_test: CPU, batch 4, eager" in out
    for variant, against in (("trainer", "bare"), ("adamw2", "trainer")):
        for row in rows(out, variant + " |"):
            assert positive(row[1]) and row[2] == against and row[3].endswith("%")
    assert len(rows(out, "monitors")) == 2
    traced = re.findall(r"5 steps traced: (\d+) aten ops a step \(no device kernels: a CPU run\)", out)
    assert len(traced) == 2 and all(int(n) > 100 for n in traced)
    assert (tmp_path / "gpt_test" / "trace.json").is_file()


def test_bench_train_times_gradient_accumulation(tmp_path):
    out = script("bench_train.py", "--models", "gpt_test", "--device", "cpu", "--batch", "4", "--seq", "32",
                 "--steps", "1", "--warmup", "0", "--eager", "--variants", "trainer", "--out", str(tmp_path),
                 "--extra", "micro_batch_size=2")
    assert "gpt_test: CPU, batch 4 in 2 micro-batches, eager, micro_batch_size=2" in out
    assert positive(rows(out, "trainer |")[0][1]) and positive(rows(out, "bare |")[0][1])


def bench_train_module():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "scripts" / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_train_reads_host_and_device_work_from_a_trace():
    bench = bench_train_module()
    assert bench.busy_share([(0, 4), (2, 6), (3, 5), (8, 9)], 0, 10) == pytest.approx(0.7)  # overlaps once
    assert bench.busy_share([(-2, 1), (9, 12)], 0, 10) == pytest.approx(0.2)  # clipped to the span
    assert bench.busy_share([], 0, 10) == 0.0

    def event(name, start, end, parent=None, device=DeviceType.CPU, annotation=False):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent,
                               device_type=device, is_user_annotation=annotation)

    steps = event(bench.STEPS, 0, 16)
    mm = event("aten::mm", 0, 3, parent=steps)
    events = [steps, mm, event("aten::empty", 1, 2, parent=mm), event("aten::add", 3, 4, parent=steps),
              event("cudaLaunchKernel", 3, 4), event("cudaStreamSynchronize", 5, 9),
              event("cudaDeviceSynchronize", 17, 20), event("cudaDeviceSynchronize", 20, 21),
              event("gemm", 2, 10, device=DeviceType.CUDA), event("add", 12, 20, device=DeviceType.CUDA),
              event("Optimizer.step#AdamW2.step", 2, 20, device=DeviceType.CUDA, annotation=True)]
    # 2 steps: aten::empty runs inside aten::mm (not dispatched by the step itself); the syncs after the
    # steps' range (the script's, the profiler's own) are no waits; the annotated range's shadow on the
    # device covers the gap 10-12, and is no device op
    assert bench.timeline(events, 2) == ("2 steps traced: 1 aten ops, 1 device ops and 0.5 host waits a step; "
                                         "the device busy 80.0% of the traced time")
    assert bench.timeline(events[:4], 1) == "1 steps traced: 2 aten ops a step (no device kernels: a CPU run)"


def test_bench_monitors(tmp_path):
    out = script("bench_monitors.py", "--model", "vit_test", "--device", "cpu", "--repeats", "1", "--warmup", "0",
                 "--out", str(tmp_path))
    assert "warm weight pass times (ms)" in out


def test_repro_warmup(tmp_path):
    script("repro_warmup.py", "--out", str(tmp_path), "--steps", "4", "--warmup", "2", "--lrs", "1e-2",
           "--batch", "4", "--extra", "model.depth=1", "model.block_size=32", "eval_every=4", "eval_batches=1")
    results = (tmp_path / "results.md").read_text()
    for variant in ("adamw_nowarmup", "adamw_warmup", "adamw2_nowarmup"):
        assert variant in results or variant.replace("_", " ") in results, results


def test_stability_bench(tmp_path):
    quick = ["--extra", "steps=5", "eval_every=5", "eval_batches=1", "monitor.probe_every=5", "logger.log_every=5"]
    out = script("stability_bench.py", "--out", str(tmp_path), "--preset", "tiny", "--lrs", "1e-3,1e-1",
                 "--fixes", "adamw", "--fix", "mine=optim=adamw2 warmup={warmup}", *quick)
    table = {r[0]: r for r in rows(out, "")[1:]}  # after the header
    assert set(table) == {"adamw", "mine"}
    assert all(c not in ("", "unfinished") for c in table["adamw"][1:3])
    assert (tmp_path / "stability.png").is_file() and (tmp_path / "stability.csv").is_file()
    assert (tmp_path / "mine" / "lr0.1" / "summary.json").is_file()
    metrics = (tmp_path / "adamw" / "lr0.001" / "metrics.jsonl").read_text()
    assert "attn_logit_max/blocks.0" in metrics and "logits/log_z" in metrics
    # resumable: a rerun launches nothing; --summarize-only rewrites the same table
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "stability_bench.py"), "--out", str(tmp_path),
                        "--preset", "tiny", "--lrs", "1e-3,1e-1", "--fixes", "adamw", *quick],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "all 2 learning rates done, skipped" in p.stderr, p.stderr
    # a run of one fix tabulates that fix: 'mine' ran in another invocation, with settings unchecked
    assert {r[0] for r in rows(p.stdout, "")[1:]} == {"adamw"} and "left out of the table" in p.stderr
    assert script("stability_bench.py", "--summarize-only", str(tmp_path)) == out
    # other settings: the points run again (they were reused silently, their table unchanged)
    fewer = [q if q != "steps=5" else "steps=3" for q in quick]
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "stability_bench.py"), "--out", str(tmp_path),
                        "--preset", "tiny", "--lrs", "1e-3,1e-1", "--fixes", "adamw", *fewer],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "[adamw] lr 0.001, 0.1 ran with other settings: running again" in p.stderr, p.stderr
    s = json.loads((tmp_path / "adamw" / "lr0.001" / "summary.json").read_text())
    assert s["total_steps"] == 3 and (tmp_path / "adamw" / "lr0.001.previous" / "summary.json").is_file()
    from stabletrain.analysis.stability import collect

    assert sorted(pt.lr for pt in collect(tmp_path)["adamw"]) == [1e-3, 1e-1]  # the old runs are no points


def test_a_stability_bench_dry_run_prints_commands_that_run_as_printed(tmp_path):
    """--dry-run prints each sweep's command; it left out the interpreter (train.py is no executable)."""
    import shlex

    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "stability_bench.py"), "--out", str(tmp_path),
                        "--preset", "tiny", "--lrs", "1e-3,1e-1", "--fixes", "adamw", "--dry-run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stderr.splitlines() if ln.startswith("[adamw] 2 of 2 learning rates: "))
    cmd = shlex.split(line.split(": ", 1)[1])
    assert cmd[:3] == [sys.executable, str(ROOT / "train.py"), "-m"] and f"hydra.sweep.dir={tmp_path}/adamw" in cmd
    assert not (tmp_path / "adamw").exists()


def test_a_stability_bench_sweep_that_never_started_says_why(tmp_path):
    """Without SLURM, --launcher slurm failed every sweep with "see launch.log": the reason, one
    line in that log, is now on the bench's own output. A PATH without sbatch or srun stands for a
    machine without SLURM (this one may have it)."""
    (tmp_path / "bin").mkdir()
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "stability_bench.py"), "--out", str(tmp_path),
                        "--preset", "tiny", "--lrs", "1e-3", "--fixes", "adamw", "--launcher", "slurm"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": str(tmp_path / "bin")})
    assert p.returncode != 0
    assert ("[adamw] sweep exited with 2: error: hydra/launcher=slurm submits through SLURM, but there is no sbatch "
            "nor srun on this machine") in p.stderr, p.stderr


@pytest.mark.parametrize("name", ["bench_train.py", "bench_optim.py", "bench_monitors.py"])
def test_a_benchmark_without_a_gpu_says_how_to_smoke_run_it(name):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / name)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[0].startswith(f"error: {name} times") and "--device cpu" in lines[0]


@pytest.mark.parametrize("name,args,error", [
    ("bench_train.py", ["--models", "nope"], "error: model=nope is not an option of 'model'; choose one of: "),
    ("bench_train.py", ["--device", "gpu"], "error: device=gpu is not an option: use auto, cpu, cuda or cuda:N"),
    ("bench_train.py", ["--variants", "sigmaa"], "error: --variants sigmaa is not a variant; choose from: trainer, "),
    ("bench_train.py", ["--batch", "0"], "error: --batch=0 must be at least 1"),
    ("bench_optim.py", ["--models", "vit_test", "--tiny"], "error: --models vit_test: this script builds its own"),
    ("bench_optim.py", ["--steps", "0", "--tiny"], "error: --steps=0 must be at least 1"),
    ("bench_optim.py", ["--profile", "adam", "--tiny"], "error: --profile adam is not a variant; choose from: "),
    ("bench_monitors.py", ["--model", "vit_test", "monitor=off"], "error: monitor=off builds no monitors to time"),
    ("bench_monitors.py", ["--model", "vit_test", "monitor.weight_everyy=3"], "error: unknown key "),
    ("repro_warmup.py", ["--lrs", "1e-2,fast"], "error: --lrs fast is not a learning rate"),
    ("repro_warmup.py", ["--extra", "optim.lrr=1"], "error: unknown key 'optim.lrr': did you mean optim.lr?"),
])
def test_a_scripts_mistake_is_one_line_before_any_work(name, args, error):
    """As train.py's: the scripts check their arguments and the configs they compose before timing
    or training anything (a bad second lr failed after an hour of the first's runs)."""
    device = [] if name == "repro_warmup.py" else ["--device", "cpu"]
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *device, *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    lines = [ln for ln in p.stderr.strip().splitlines() if "No CUDA runtime" not in ln]
    assert p.returncode != 0 and "Traceback" not in p.stderr and lines[-1].startswith(error), p.stderr[-2000:]



def test_the_analysis_scripts_name_the_file_they_cannot_use(tmp_path):
    """An unreadable summary.json, a figure format matplotlib has not, an --out that is a file:
    one line naming it, not a traceback."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (run / "summary.json").write_text('{"status": "compl')
    (tmp_path / "notes.txt").write_text("x")
    cases = [("plot_dynamics.py", [str(run)], f"error: {run / 'summary.json'} is not readable JSON"),
             ("compare_runs.py", [str(run), "--out", str(tmp_path / "o")], f"error: {run / 'summary.json'} is not"),
             ("summarize_sweep.py", [str(tmp_path), "--plot", str(tmp_path / "p.txt")], "error: --plot "),
             ("prepare_tokens.py", ["--out", str(tmp_path / "notes.txt"), "--files", str(tmp_path / "notes.txt")],
              f"error: --out {tmp_path / 'notes.txt'} is a file")]
    for name, args, error in cases:
        p = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        assert p.returncode == 2 and "Traceback" not in p.stderr and last.startswith(error), (name, p.stderr[-2000:])
