"""What the commands write besides their printout: ``--json PATH`` reports."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from remat.errors import ConfigError

logger = logging.getLogger(__name__)


def write_json(path: str | Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON to ``--json PATH`` (parent directories created); `ConfigError` naming the
    flag when it cannot be written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")
    except OSError as err:
        raise ConfigError(f"--json: cannot write {str(path)!r}: {err.strerror or err}") from err
    logger.info("wrote %s", path)
