"""``compile=true`` under torchrun, two gloo ranks: DDP and FSDP2 train the eager run's numbers,
and under FSDP2 every block of a parametrized (sigmaReparam) model is compiled."""

from __future__ import annotations

import pytest

from tests.distributed.common import GPT, run, torchrun_cmd
from tests.helpers import has_cpp_compiler, losses

# nine blocks: one more than dynamo's default recompile limit; sigmaReparam gives each block's
# layers classes of their own, so under FSDP2 each block compiles on its own
ARGS = [*GPT, "model.depth=9", "reparam=sigma", "optim=adamw2", "batch_size=8", "steps=3"]


@pytest.mark.skipif(not has_cpp_compiler(), reason="inductor needs a C++ compiler on the CPU")
def test_compiled_ddp_and_fsdp_train_the_eager_run(tmp_path):
    def torchrun(name, *overrides):
        out = run(torchrun_cmd(2, *ARGS, f"hydra.run.dir={tmp_path / name}", *overrides), cwd=tmp_path, timeout=400)
        return out.stdout + out.stderr, losses(tmp_path / name)

    _, eager = torchrun("eager", "parallel=ddp")
    for parallel in ("ddp", "fsdp"):
        log, got = torchrun(parallel, f"parallel={parallel}", "compile=true")
        assert "recompile_limit" not in log, f"{parallel}: a block fell back to eager:\n{log[-3000:]}"
        assert sorted(got) == sorted(eager) == [1, 2, 3]
        for step, loss in eager.items():
            assert got[step] == pytest.approx(loss, rel=1e-4), (parallel, step)
