"""A tiny random *hybrid* Llama (full + sliding-window attention), built offline.

The sibling of ``kvd.demo.tiny_model`` for vLLM's hybrid KV-cache manager
(HMA): the same tokenizer (``tiny_model._train_tokenizer``), the same sizes and
the same wide normal init, but 4 layers whose ``layer_types`` alternate
``sliding_attention`` / ``full_attention`` with ``sliding_window`` =
``SLIDING_WINDOW`` (64) tokens. vLLM's ``LlamaAttention`` reads both keys
(``vllm/model_executor/models/llama.py:185-204``: a sliding layer gets
``per_layer_sliding_window=config.sliding_window``), so vLLM gives the sliding
layers a ``SlidingWindowSpec`` and the full layers a ``FullAttentionSpec``;
with HMA on (vLLM-CPU's platform supports it and KvdConnector is
``SupportsHMA``) the engine has 2 KV-cache groups of 2 layers each, laid over
the same 2 KV-cache tensors (a full and a sliding layer share one tensor).

Per token the KV cache holds 4 layers x (K + V) x 2 KV heads x 32 head_dim x
4 bytes = 2048 bytes (1024 per group); a 32-token block of one group is
32 KiB. A sliding group keeps ``cdiv(64, 32) + 1`` = 3 blocks of a request.

The output directory holds a ``kvd_recipe.json`` stamp; ``build()`` skips the
work when it matches ``RECIPE``. Building takes about 8 s (the tokenizer).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvd.demo import tiny_model

RECIPE_VERSION = 1
SEED = 4321
SLIDING_WINDOW = 64  # tokens; smaller than the test prompts so that clipping matters
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

MODEL_CONFIG = dict(
    tiny_model.MODEL_CONFIG,
    num_hidden_layers=len(LAYER_TYPES),
    layer_types=LAYER_TYPES,
    sliding_window=SLIDING_WINDOW,
)

RECIPE = {
    "recipe_version": RECIPE_VERSION,
    "arch": "llama-hybrid",
    "seed": SEED,
    "vocab_size": tiny_model.VOCAB_SIZE,
    "train_bytes": tiny_model.TRAIN_BYTES,
    "init_gain": tiny_model.INIT_GAIN,
    "model": MODEL_CONFIG,
    "python": "%d.%d" % sys.version_info[:2],
}
STAMP = tiny_model.STAMP

# Bytes of KV cache per token of ONE KV-cache group (2 layers; float32).
KV_BYTES_PER_TOKEN_PER_GROUP = (
    LAYER_TYPES.count("full_attention") * 2 * MODEL_CONFIG["num_key_value_heads"]
    * MODEL_CONFIG["head_dim"] * 4
)


def default_dir() -> Path:
    """``$KVD_TINY_HYBRID_DIR`` or ``~/.cache/kvd/tiny-hybrid``."""
    env = os.environ.get("KVD_TINY_HYBRID_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvd" / "tiny-hybrid"


def is_built(path: Path) -> bool:
    """True when ``path`` holds a model built with the current ``RECIPE``."""
    return tiny_model.is_built(path, RECIPE)


def _build_model(out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(**MODEL_CONFIG, torch_dtype="float32")
    if list(getattr(config, "layer_types", None) or []) != LAYER_TYPES:
        raise RuntimeError("this transformers' LlamaConfig drops layer_types; "
                           "vLLM would build a non-hybrid model")
    model = LlamaForCausalLM(config).to(torch.float32)
    tiny_model.init_weights(model, SEED, MODEL_CONFIG["hidden_size"])
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["layer_types"], cfg["sliding_window"] = LAYER_TYPES, SLIDING_WINDOW  # belt and braces
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tiny_model.write_generation_config(out_dir, MODEL_CONFIG)


def build(path: str | os.PathLike | None = None, force: bool = False,
          quiet: bool = False) -> Path:
    """Build the tiny hybrid model into ``path`` (default ``default_dir()``);
    see ``tiny_model.build_into``. Returns the directory.

    Raises:
        RuntimeError: the installed transformers drops ``layer_types``.
    """
    return tiny_model.build_into(Path(path) if path is not None else default_dir(), RECIPE, _build_model,
                                 "tiny hybrid model", force=force, quiet=quiet)


def main(argv: list[str] | None = None) -> int:
    """``kvd-tiny-hybrid [PATH] [--force]``: builds the tiny hybrid model and prints its directory. Returns 0."""
    return tiny_model.cli(argv, "kvd-tiny-hybrid", __doc__.splitlines()[0], build)


if __name__ == "__main__":
    sys.exit(main())
