"""A tiny random DeepSeek-V2 (MLA) model, built locally without a model hub.

The MLA variant of :mod:`kvd.demo.tiny_model` (same tokenizer, same build
style: deterministic, stamped, built in a temporary sibling directory and
renamed into place), for the real-engine MLA test
(``tests/test_vllm_e2e_mla.py``).

- the same byte-level BPE tokenizer (``tiny_model._train_tokenizer``);
- a ``DeepseekV2ForCausalLM``: hidden 128, 2 layers, 4 attention heads,
  dense MLPs only (``first_k_dense_replace`` = 2 layers: no MoE layer is
  built, by vLLM's ``deepseek_v2.py`` rule ``layer_idx >=
  first_k_dense_replace``), no q LoRA (``q_lora_rank`` None),
  ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64: vLLM-CPU's reference MLA
  backend (``vllm/v1/attention/backends/mla/cpu_mla.py``, ``CPU_MLA``)
  supports only the 576-element latent (``get_supported_head_sizes``) and
  16-token blocks (``cpu_mla.py`` ``supports_block_size``; the CPU platform
  forces ``block_size = 16`` for MLA, ``platforms/cpu.py``);
  ``qk_nope_head_dim`` 32 and ``v_head_dim`` 32 (the decode kernel works in
  the 512-wide latent space; ``v_head_dim`` is only the up-projection's);
  float32, seed ``SEED``, normal init std = ``INIT_GAIN / sqrt(fan_in)``.

Per token the KV cache holds 2 layers x 576 x 4 bytes = 4608 bytes (one
latent vector per layer, no K/V split, no heads), i.e. 36 KiB per layer and
72 KiB per 16-token block over both layers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvd.demo import tiny_model

RECIPE_VERSION = 1
SEED = 4321
INIT_GAIN = 2.0  # std = INIT_GAIN / sqrt(fan_in)
BLOCK_SIZE = 16  # what vLLM-CPU forces for MLA (platforms/cpu.py)
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64

MODEL_CONFIG = dict(
    vocab_size=tiny_model.VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=KV_LORA_RANK,
    q_lora_rank=None,
    qk_nope_head_dim=32,
    qk_rope_head_dim=QK_ROPE_HEAD_DIM,
    v_head_dim=32,
    first_k_dense_replace=2,  # == num_hidden_layers: every layer dense
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

RECIPE = {
    "recipe_version": RECIPE_VERSION,
    "kind": "deepseek_v2_mla",
    "seed": SEED,
    "tokenizer": {"vocab_size": tiny_model.VOCAB_SIZE, "train_bytes": tiny_model.TRAIN_BYTES},
    "init_gain": INIT_GAIN,
    "model": MODEL_CONFIG,
    "python": "%d.%d" % sys.version_info[:2],
}
STAMP = tiny_model.STAMP

# The MLA latent per token and layer (elements), and its bytes (float32).
LATENT_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM
KV_BYTES_PER_TOKEN = MODEL_CONFIG["num_hidden_layers"] * LATENT_DIM * 4


def default_dir() -> Path:
    """``$KVD_TINY_MLA_DIR`` or ``~/.cache/kvd/tiny-mla``."""
    env = os.environ.get("KVD_TINY_MLA_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvd" / "tiny-mla"


def is_built(path: Path) -> bool:
    """True when ``path`` holds a model built with the current ``RECIPE``."""
    return tiny_model.is_built(path, RECIPE)


def _build_model(out_dir: Path) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(SEED)
    config = DeepseekV2Config(**MODEL_CONFIG)
    config.dtype = "float32"
    model = DeepseekV2ForCausalLM(config).to(torch.float32)
    tiny_model.init_weights(model, SEED, MODEL_CONFIG["hidden_size"], gain=INIT_GAIN)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() != 2:  # RMSNorm weights (incl. kv_a_layernorm): 1
                param.fill_(1.0)
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tiny_model.write_generation_config(out_dir, MODEL_CONFIG)


def build(path: str | os.PathLike | None = None, force: bool = False,
          quiet: bool = False) -> Path:
    """Build the tiny MLA model into ``path`` (default ``default_dir()``);
    see ``tiny_model.build_into``. Returns the directory. About 10 s on two
    cores (the tokenizer is most of it).

    Raises:
        ImportError: ``transformers``/``tokenizers``/``torch`` missing.
    """
    return tiny_model.build_into(Path(path) if path is not None else default_dir(), RECIPE, _build_model,
                                 "tiny MLA model", force=force, quiet=quiet)


def main(argv: list[str] | None = None) -> int:
    """``kvd-tiny-mla [PATH] [--force]``: builds the tiny MLA model and prints its directory. Returns 0."""
    return tiny_model.cli(argv, "kvd-tiny-mla", __doc__.splitlines()[0], build)


if __name__ == "__main__":
    sys.exit(main())
