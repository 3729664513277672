"""stabletrain entry point: ``python train.py [group=option] [key=value] ...``.

Works as a plain process, under ``torchrun``, under ``srun``, and as a Hydra multirun
(``-m``, locally or on SLURM through submitit). Config mistakes are reported in one line.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig

from stabletrain.cli import check_overrides
from stabletrain.config import register
from stabletrain.run import main_guarded

register()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg) -> None:
    main_guarded(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    check_overrides(sys.argv[1:])
    main()
