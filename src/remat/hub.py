"""Hugging Face Hub ids: what one looks like, whether its repository can be reached (online, or in the HF cache when
offline), and the one-line error when it cannot. Resolution itself is transformers' (``from_pretrained``)."""

from __future__ import annotations

import logging
import os
import re
import sys

from remat.errors import ConfigError

logger = logging.getLogger(__name__)

#: How long the Hub gets to answer remat's one probe (tried twice) before the run reads Hub ids from the cache only.
HUB_PROBE_TIMEOUT_S = 3.0
_probed = False
_went_offline = False  # this process switched to offline mode because the Hub did not answer

# A Hub repository id as huggingface_hub accepts one: "name" or "org/name", each part up to 96 characters of letters,
# digits, "-", "_" and ".", neither starting nor ending with "-" or "." and with no "--" or "..".
_HUB_PART = r"(?!.*(?:--|\.\.))[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"{_HUB_PART}(?:/{_HUB_PART})?")


def is_hub_id(value: str) -> bool:
    """Whether `value` is shaped like a Hugging Face Hub repository id ("org/name" or "name"); nothing is looked up."""
    return _HUB_ID.fullmatch(value) is not None


def offline_unless_reachable() -> None:
    """Before this process's first Hub request: unless ``HF_HUB_OFFLINE`` is set, ask the Hub endpoint once (twice at
    most, `HUB_PROBE_TIMEOUT_S` each); when it does not answer, this process and the ones it starts read Hub ids from
    the local cache only (offline mode), said in one WARNING line.

    # NOTE [ An unreachable Hub is one line ]
    # huggingface_hub retries a request that cannot connect five times with back-off (about 25 s per file) and logs
    # each retry; a run that resolves a config, a tokenizer and a dataset took 86 s and printed some 60 lines
    # before its one-line error. Any answer of the endpoint (an error status included) means the Hub is reachable.
    """
    global _probed, _went_offline
    from huggingface_hub import constants

    if _probed or constants.HF_HUB_OFFLINE:
        return
    _probed = True
    from huggingface_hub.utils import get_session

    reason = ""
    for _ in range(2):
        try:
            get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
            return
        except Exception as err:  # noqa: BLE001 (the HTTP client's connection errors: httpx's or httpx2's by version)
            reason = f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
    constants.HF_HUB_OFFLINE = _went_offline = True
    os.environ["HF_HUB_OFFLINE"] = "1"  # the libraries that read it at import, and the processes this one starts
    if "datasets.config" in sys.modules:
        sys.modules["datasets.config"].HF_HUB_OFFLINE = True
    logger.warning("the Hugging Face Hub (%s) did not answer (%s): this run reads Hub ids from the local cache only "
                   "(HF_HUB_OFFLINE=1 skips this check)", constants.ENDPOINT, reason)


def hub_model_available(hub_id: str) -> bool:
    """Whether the model repository `hub_id` resolves: its config.json downloads, or is in the HF cache offline."""
    from transformers.utils import cached_file

    offline_unless_reachable()

    try:
        cached_file(hub_id, "config.json")
    except OSError:
        return False
    return True


def hub_config_file(hub_id: str, key: str) -> str:
    """The local path of the model repository's config.json (downloaded, or from the HF cache offline); one-line
    ConfigError naming ``key`` when it cannot be had. Only that file is fetched: no weights."""
    from transformers.utils import cached_file

    offline_unless_reachable()

    try:
        path = cached_file(hub_id, "config.json")
    except OSError as err:
        raise hub_load_error(key, hub_id, "read config.json", err) from None
    if path is None:
        raise ConfigError(f"{key}: the Hub repository {hub_id!r} has no config.json")
    return str(path)


def hub_load_error(key: str, hub_id: str, action: str, err: Exception, hint: str = "", *,
                   repo_type: str = "model") -> ConfigError:
    """One line: ``KEY: cannot ACTION for the Hub id ID (what to do; HINT): REASON``."""
    from huggingface_hub import constants

    where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if repo_type == "dataset":
        import datasets

        where = f"the Hugging Face datasets cache ({datasets.config.HF_DATASETS_CACHE})"
    download = f"hf download {hub_id}" if repo_type == "model" else \
        f"python -c \"import datasets; datasets.load_dataset('{hub_id}')\""
    if constants.is_offline_mode():
        why = "the Hub did not answer" if _went_offline else "HF_HUB_OFFLINE is set"
        advice = f"{why} and {hub_id!r} is not in {where}: download it while online (`{download}`)"
    else:
        advice = f"check the id, your network and, for gated models, your token (`hf auth login`); cache: {where}"
    reason = " ".join(str(err).split())  # transformers' and huggingface_hub's messages span several lines
    return ConfigError(f"{key}: cannot {action} for the Hub id {hub_id!r} ({advice}{hint}): {reason}")
