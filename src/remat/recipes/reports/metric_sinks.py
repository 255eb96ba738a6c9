"""Optional places a run's scalars also go, besides its log line and metrics file: TensorBoard and Weights & Biases.

Each sink takes ``scalars(step, {"train/loss": ..., ...})`` and ``close()``. Neither package is required: a recipe
that asks for one that is not installed gets one line naming the extra to install. W&B runs resume: the run id is
kept in ``OUTPUT_DIR/wandb_run_id``, so a resumed fine-tune continues the same W&B run.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Protocol

from remat._files import write_atomic
from remat.errors import ConfigError
from remat.recipes.config import LoggingConfig, WandbConfig
from remat.recipes.run_safety.output_paths import WANDB_ID_FILE



class MetricSink(Protocol):
    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars as TensorBoard events under ``OUTPUT_DIR/tensorboard``."""

    def __init__(self, output_dir: Path, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError(
                "logging.tensorboard: true needs the tensorboard package: pip install 'remat[tensorboard]'"
            ) from err
        # purge_step: a resumed run drops the events an interrupted attempt logged after its last checkpoint
        self._writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Scalars logged to a Weights & Biases run (``logging.wandb``), with the recipe as the run's config."""

    def __init__(self, cfg: WandbConfig, output_dir: Path, recipe: dict[str, Any] | None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ConfigError("logging.wandb: needs the wandb package: pip install 'remat[wandb]' (or remove the "
                              "logging.wandb section)") from err
        id_file = output_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        self._run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name, group=cfg.group,
                               tags=list(cfg.tags), mode=cfg.mode, dir=str(output_dir), id=run_id, resume="allow",
                               config=recipe)
        write_atomic(id_file, run_id + "\n", "logging.wandb run id file")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


def open_sinks(cfg: LoggingConfig, output_dir: Path, recipe: dict[str, Any] | None = None, *,
               start_step: int = 0) -> list[MetricSink]:
    """The sinks ``cfg`` asks for, opened (``output_dir`` exists; a run resumed at ``start_step`` continues there)."""
    sinks: list[MetricSink] = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(output_dir, purge_step=start_step + 1 if start_step else None))
    if cfg.wandb is not None:
        sinks.append(WandbSink(cfg.wandb, output_dir, recipe))
    return sinks
