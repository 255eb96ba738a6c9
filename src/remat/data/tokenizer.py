"""Tokenizers: from a local path, from the model (its directory or Hub repository), or the builtin byte-level BPE
(trained once, cached).

The builtin tokenizer is trained with the `tokenizers` library on the train split of the builtin corpus (well under a
second), saved atomically under `$REMAT_CACHE_DIR/tokenizers/<fingerprint>/` (default `~/.cache/remat`) and loaded
from there on later builds. Only a Hub model's own tokenizer is downloaded (by transformers, into the Hugging Face
cache; read from that cache when offline).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from remat._files import open_regular
from remat.data.config import TokenizerConfig
from remat.data.corpus import builtin_corpus_fingerprint, builtin_documents
from remat.errors import ConfigError
from remat.hub import hub_load_error, hub_model_available, offline_unless_reachable

logger = logging.getLogger(__name__)

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)

# One turn is `<|role|>\n{content}<|eos|>`; the conversation opens with BOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Bump when the way the builtin tokenizer is trained or saved changes, so old caches are not reused.
_BUILTIN_RECIPE_VERSION = 2
_MODEL_KEY = "model.pretrained_model_name_or_path"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def cache_dir() -> Path:
    """The root of remat's on-disk cache: `$REMAT_CACHE_DIR`, else `~/.cache/remat`."""
    configured = os.environ.get("REMAT_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "remat"


def has_tokenizer_files(directory: str | os.PathLike[str]) -> bool:
    """Whether `directory` is a local directory holding files a `transformers` tokenizer loads from."""
    path = Path(directory)
    return path.is_dir() and any((path / name).is_file() for name in _TOKENIZER_FILES)


def builtin_tokenizer_fingerprint(vocab_size: int) -> str:
    """A short digest of everything the builtin tokenizer depends on (corpus, settings, library version)."""
    settings = {
        "recipe": _BUILTIN_RECIPE_VERSION,
        "vocab_size": vocab_size,
        "special_tokens": SPECIAL_TOKENS,
        "chat_template": CHAT_TEMPLATE,
        "corpus": builtin_corpus_fingerprint(),
        "tokenizers": tokenizers.__version__,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def train_byte_level_bpe(documents: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with the builtin special tokens on `documents` (every byte stays representable)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def _wrap_builtin(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _save_atomically(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Write into a private temporary directory, then rename it to `target` (a concurrent winner is kept)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # HOME=/proc, a read-only home, a file where a folder belongs: one line, not a traceback
        raise ConfigError(f"the cache directory {str(cache_dir())!r} cannot be created ({err.strerror or err}); "
                          "allowed: a writable place, set with REMAT_CACHE_DIR (the builtin tokenizer is cached "
                          "there)") from None
    staging = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tokenizer.save_pretrained(str(staging))
        try:
            os.rename(staging, target)
        except OSError:
            if not has_tokenizer_files(target):
                raise
            logger.debug("another process cached the builtin tokenizer at %s first; keeping theirs", target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def builtin_tokenizer(vocab_size: int = 4096) -> PreTrainedTokenizerBase:
    """The builtin byte-level BPE tokenizer, trained on the first call and loaded from the cache afterwards."""
    target = cache_dir() / "tokenizers" / builtin_tokenizer_fingerprint(vocab_size)
    if not (target / "tokenizer.json").is_file():
        trained = train_byte_level_bpe(builtin_documents("train"), vocab_size)
        if trained.get_vocab_size() < vocab_size:
            logger.warning(
                "tokenizer.vocab_size=%d is more than the builtin corpus supports; "
                "the builtin tokenizer has %d entries (size the model's vocabulary with len(tokenizer))",
                vocab_size,
                trained.get_vocab_size(),
            )
        _save_atomically(_wrap_builtin(trained), target)
        logger.info("trained the builtin tokenizer (%d entries) into %s", trained.get_vocab_size(), target)
    return AutoTokenizer.from_pretrained(str(target), local_files_only=True, trust_remote_code=False)


def load_tokenizer_from_path(path: str, *, key: str = "tokenizer.path",
                             trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local directory (AutoTokenizer) or a `tokenizer.json` file; ConfigError otherwise.

    ``trust_remote_code`` is passed to transformers explicitly (NOTE [ No prompt, no tokenizer code ])."""
    location = Path(path).expanduser()
    allowed = f"a local directory with tokenizer files ({', '.join(_TOKENIZER_FILES)}) or a tokenizer.json file"
    _check_tokenizer_files(location, key)
    if location.is_file():
        if location.suffix != ".json":
            raise ConfigError(f"{key}: {path!r} is a file but not a tokenizer .json file; expected {allowed}")
        try:
            return PreTrainedTokenizerFast(tokenizer_file=str(location))
        except Exception as exc:  # the tokenizers library raises its own exception types for malformed files
            raise ConfigError(f"{key}: cannot load {path!r} as a tokenizer.json file: {exc}") from exc
    if not location.exists():
        raise ConfigError(f"{key}: {path!r} does not exist; expected {allowed}")
    if not has_tokenizer_files(location):
        raise ConfigError(f"{key}: directory {path!r} holds no tokenizer files; expected {allowed}")
    try:
        return AutoTokenizer.from_pretrained(str(location), local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if "trust_remote_code" in str(exc):
            raise ConfigError(f"{key}: the tokenizer in {path!r} names Python code of its own (auto_map in "
                              "tokenizer_config.json), which remat never runs from a recipe; allowed: a tokenizer "
                              "of transformers' own classes (a tokenizer.json file), or trusting the model's code on "
                              "the command line (remat finetune RECIPE --trust-remote-code)") from None
        raise ConfigError(f"{key}: cannot load a tokenizer from {path!r}: {' '.join(str(exc).split())}") from exc


#: The largest tokenizer file read (published tokenizer.json files are at most a few tens of MB; the tokenizers
#: library holds several times a file's size while it parses, and a 300 MB token grew a process to 9.9 GB).
TOKENIZER_FILE_LIMIT = 256 << 20


def _check_tokenizer_files(location: Path, key: str) -> None:
    """ConfigError naming ``key`` when a tokenizer file there is not a regular file or is larger than
    `TOKENIZER_FILE_LIMIT` (checked before the tokenizers library reads it)."""
    files = [location] if location.is_file() else [location / name for name in _TOKENIZER_FILES]
    for file in files:
        if not (file.exists() or file.is_symlink()):
            continue
        open_regular(file, key).close()  # a FIFO or a device is one line, not a hang
        size = file.stat().st_size
        if size > TOKENIZER_FILE_LIMIT:
            raise ConfigError(f"{key}: {file} holds {size:,} bytes; allowed: at most {TOKENIZER_FILE_LIMIT:,} (no "
                              "published tokenizer comes near it)")


def _hub_tokenizer(hub_id: str, trust_remote_code: bool) -> PreTrainedTokenizerBase | str:
    """The tokenizer of the Hub model `hub_id`, resolved as transformers does (the HF cache when offline), or why
    none loads (one line). A repository that cannot be reached at all is a ConfigError naming the model key (the
    model could not be loaded either)."""
    offline_unless_reachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(hub_id, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if not hub_model_available(hub_id):
            raise hub_load_error(_MODEL_KEY, hub_id, "load the tokenizer", exc) from exc
        return " ".join(str(exc).split())
    logger.info("loaded the tokenizer of the Hub model %s", hub_id)
    return tokenizer


def _is_hub_id(model_path: str | None) -> bool:
    return model_path is not None and not Path(model_path).expanduser().exists()


def tokenizer_vocabulary(cfg: TokenizerConfig, model_path: str | None = None, *,
                         trust_remote_code: bool = False) -> int | None:
    """The number of tokens the recipe's run trains with, for a memory estimate (which reads no data): the length of
    the tokenizer `build_tokenizer` loads, or None, the model config's vocabulary, when a Hub model's tokenizer does
    not load here (not in the HF cache offline, or none in the repository), said in one line. The run grows the
    embeddings only for a tokenizer with more tokens than the model has rows."""
    if cfg.path is None and _is_hub_id(model_path):
        tokenizer = _hub_tokenizer(str(model_path), trust_remote_code)
        if isinstance(tokenizer, str):
            logger.info("the tokenizer of %s does not load here (not in the HF cache, or the repository has none): "
                        "estimating with the model config's vocabulary", model_path)
            return None
        return len(tokenizer)
    return len(build_tokenizer(cfg, model_path, trust_remote_code=trust_remote_code))


def build_tokenizer(cfg: TokenizerConfig, model_path: str | None = None, *,
                    trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer a recipe asks for: `cfg.path`, else the model's own (its local directory's tokenizer files, or
    the Hub repository's tokenizer for a Hub id), else the builtin one.

    # NOTE [ No prompt, no tokenizer code ]
    # A tokenizer directory can name a Python class of its own (``auto_map`` in tokenizer_config.json). Left
    # unspecified, transformers *asks* on stdin whether to run that code, so a piped "y" ran a planted file. Every
    # tokenizer load passes ``trust_remote_code`` explicitly: False, unless the command line trusted the model's code
    # (``--trust-remote-code``, which a recipe file cannot set); a tokenizer that needs its code then fails to load
    # in one line instead of asking.
    """
    if cfg.path is not None:
        logger.info("loading the tokenizer from %s", cfg.path)
        return load_tokenizer_from_path(cfg.path, trust_remote_code=trust_remote_code)
    if model_path is not None and has_tokenizer_files(Path(model_path).expanduser()):
        logger.info("loading the tokenizer from the model directory %s", model_path)
        return load_tokenizer_from_path(model_path, key=_MODEL_KEY, trust_remote_code=trust_remote_code)
    if _is_hub_id(model_path):
        hub_tokenizer = _hub_tokenizer(str(model_path), trust_remote_code)
        if not isinstance(hub_tokenizer, str):
            return hub_tokenizer
        logger.warning("no tokenizer loads for the Hub model %s (%s); using the builtin tokenizer (set "
                       "tokenizer.path to choose one)", model_path, hub_tokenizer)
        return builtin_tokenizer(cfg.vocab_size)
    if model_path is not None:
        logger.info("%s has no tokenizer files; using the builtin tokenizer", model_path)
    return builtin_tokenizer(cfg.vocab_size)
