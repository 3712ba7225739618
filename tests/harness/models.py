"""Tiny random-weight multimodal checkpoints built offline, for the e2e tests.

Why: the e2e tests start the real SGLang and vLLM servers on CPU, with the
real OpenAI client sending real photos, videos and sounds, but no model hub
can be reached and these machines have 2 cores. Real checkpoints are neither
downloadable nor runnable here, so this builds models of the real
architectures and file layouts, only tiny. One shared core (tokenizer,
weight drawing, the Qwen2 text decoder, the files every family has) and one
builder per family (``FAMILIES``):

- ``qwen2-vl`` (the default; ``Qwen/Qwen2-VL-2B-Instruct``'s layout):
  ``Qwen2VLForConditionalGeneration``, images and videos (``pixel_values``,
  ``pixel_values_videos``). 2 vision blocks of embed 128 (4 heads) with the
  real patch_size 14, spatial_merge_size 2, temporal_patch_size 2, and a
  merger whose output width is the text hidden. A 720p photo still becomes
  pixel_values [4784, 1176] float32 (22 MB), so the transport carries
  real-sized tensors; the image takes 1196 tokens.
- ``qwen2.5-vl`` (``Qwen/Qwen2.5-VL-3B-Instruct``'s layout):
  ``Qwen2_5_VLForConditionalGeneration``: the same patching (a 720p photo is
  the same [4784, 1176] float32), a vision tower of embed 128 in 2 heads of
  64 with RMSNorm, a gated MLP, window attention (window 112) in block 0 and
  full attention in block 1; videos through ``Qwen2VLVideoProcessor`` (its
  own ``video_preprocessor_config.json``, the real defaults:
  128*28*28 to 768*28*28 pixels a frame, 2 frames a temporal patch).
- ``llava-next`` (``llava-hf/llava-next-72b-hf``'s layout: a Qwen2 text
  model): ``LlavaNextForConditionalGeneration`` with a CLIP vision tower
  (``clip_vision_model``, 336 px, patch 14, 2 layers of 128 in 2 heads, the
  feature layer -2, strategy ``default``), anyres tiles on LLaVA-1.6's
  ``image_grid_pinpoints`` and ``image_newline``. A 720p photo becomes 5
  tiles, pixel_values [5, 3, 336, 336] float32 (6.8 MB) and ``image_sizes``
  [720, 1280]; 1948 tokens.
- ``qwen2-audio`` (``Qwen/Qwen2-Audio-7B-Instruct``'s layout):
  ``Qwen2AudioForConditionalGeneration``, a Whisper-style encoder (128 mel
  bins, 2 layers of d_model 128 in 2 heads, 1500 positions, sinusoidal
  position table as Whisper's) and a linear projector. Every clip becomes
  ``input_features`` [128, 3000] float32 (1.5 MB: the WhisperFeatureExtractor
  pads to 30 s at 16 kHz) and a ``feature_attention_mask`` [3000]; a 2 s clip
  takes 50 tokens.

Text model, in every family: Qwen2, 2 layers of hidden 128 (2 heads of 64,
as TP=2 shards them; ``heads`` scales it), float32.

Files, in every family:

- ``config.json`` in the hub's layout (Qwen2-VL and Qwen2.5-VL flat, text
  fields at the top level and ``rope_scaling`` ``mrope``; LLaVA-NeXT and
  Qwen2-Audio with a nested ``text_config``), which transformers 4.x and 5.x,
  vLLM and SGLang all read.
- A byte-level BPE tokenizer (Qwen2's pre-tokenizer regex) trained with
  `tokenizers` on a fixed set of Python stdlib sources, plus Qwen2-VL's 14
  special tokens appended after it, as in the real vocabulary, then the
  family's own (``<image>``; ``<|audio_bos|>``, ``<|AUDIO|>``,
  ``<|audio_eos|>``): the trained part is the same in every family. Their
  ids go into config.json and generation_config.json (bos/eos/pad only: no
  sampling defaults, which the servers would apply).
- The family's real chat template (tokenizer_config.json and
  chat_template.json, where both transformers generations find it).
- The processor's configs (``preprocessor_config.json``, and
  ``video_preprocessor_config.json`` / ``processor_config.json`` where the
  family has them), so that ``AutoProcessor.from_pretrained(dir)`` works
  offline.
- ``model.safetensors``: float32 weights drawn from N(0, 0.3) with a fixed
  seed (biases 0, norms 1), under the hub checkpoint's key names (Qwen2-VL's
  ``model.*``/``visual.*``/``lm_head.*``; LLaVA-NeXT's and Qwen2-Audio's
  ``language_model.*``, ``vision_tower.*``/``audio_tower.*``,
  ``multi_modal_projector.*``). They are written directly with safetensors
  rather than through `save_pretrained`: transformers 4.57 and 5.x lay a
  model's keys out differently, while every loader (both transformers
  generations, vLLM, SGLang) reads the hub layout. The large std makes the
  outputs depend on the inputs: a different photo changes the logprobs.

The build is deterministic and takes a few seconds. It is idempotent: a
stamp file per family holds a hash of this file's source and of the
tokenizer corpus, and a directory with a matching stamp is reused; a stale
or partial one is rebuilt. ``qwen2-vl``'s files are those this module built
before it had other families.

    build(path, family="qwen2-vl", heads=2) -> str   # the model directory
    model_dir(family) -> Path                         # <repo>/.venvs/tiny-<family>
    python -m tests.harness.models [--family F] [--heads N] DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

#: The families :func:`build` knows, by name.
FAMILIES = ("qwen2-vl", "qwen2.5-vl", "llava-next", "qwen2-audio")
STAMP = ".tiny-qwen2-vl-stamp"  # qwen2-vl's; the others: .tiny-<family>-stamp
SEED = 20261201
INIT_STD = 0.3

# Text model (Qwen2). head_dim = hidden / heads = 64, a head size every CPU
# attention backend supports; heads and KV heads divide by TP=2.
HIDDEN = 128
HEADS = 2
KV_HEADS = 2
INTERMEDIATE = 256
LAYERS = 2
MROPE_SECTION = [8, 12, 12]  # sums to head_dim / 2
# Qwen2-VL's vision tower: the real patching, a tiny width.
V_DEPTH = 2
V_EMBED = 128
V_HEADS = 4
V_MLP_RATIO = 4
PATCH = 14
MERGE = 2
TEMPORAL = 2
IN_CHANS = 3
# Qwen2.5-VL's vision tower: RMSNorm, gated MLP, window attention but in block 1.
V25_HEADS = 2
V25_INTERMEDIATE = 256
V25_WINDOW = 112
V25_FULLATT = [1]
# LLaVA-NeXT's CLIP ViT (ViT-L/14-336's geometry, a tiny width).
CLIP_SIZE = 336
CLIP_EMBED = 128
CLIP_HEADS = 2
CLIP_INTERMEDIATE = 512
CLIP_LAYERS = 2
#: LLaVA-1.6's anyres grid (height, width), as in llava-hf's configs.
GRID_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
# Qwen2-Audio's Whisper-style encoder.
A_MELS = 128
A_DMODEL = 128
A_HEADS = 2
A_FFN = 512
A_LAYERS = 2
A_POSITIONS = 1500
# Tokenizer: trained tokens + 14 special tokens = VOCAB (+ a family's own).
VOCAB = 1536

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2's pre-tokenizer split (tokenizer.json of the Qwen2 family).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2-VL-Instruct's chat template, verbatim.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Stable stdlib modules whose source and docstrings train the tokenizer.
CORPUS_FILES = [
    "argparse.py", "bisect.py", "calendar.py", "colorsys.py", "csv.py", "dataclasses.py",
    "difflib.py", "enum.py", "fnmatch.py", "fractions.py", "functools.py", "glob.py",
    "heapq.py", "json/decoder.py", "json/encoder.py", "pprint.py", "random.py", "shlex.py",
    "statistics.py", "string.py", "textwrap.py", "this.py",
]


#: Extra special tokens of a family, appended after Qwen2-VL's 14.
FAMILY_TOKENS = {
    "qwen2-vl": [],
    "qwen2.5-vl": [],
    "llava-next": ["<image>"],
    "qwen2-audio": ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"],
}

# llava-hf/llava-next-72b-hf's chat template (Qwen2's turns, images first).
LLAVA_NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'text') %}{{ content['text'] }}{% endfor %}{{'<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2AudioProcessor's chat template (transformers' default_chat_template,
# which also renders vLLM's {"type": "audio"} parts).
QWEN2_AUDIO_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or message['type'] == 'audio' "
    "or content['type'] == 'audio' %}{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in CORPUS_FILES:
        p = stdlib / name
        if p.is_file():
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
    if not texts:
        raise RuntimeError(f"no tokenizer corpus found under {stdlib}")
    return texts


def _stamp_value(texts: list[str]) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    for t in texts:
        h.update(t.encode("utf-8", "replace"))
    return h.hexdigest()[:32]


# -- shared core: tokenizer ------------------------------------------------------------
def _train_tokenizer(texts: list[str], extra: list[str] = ()):
    """The byte-level BPE, trained to ``VOCAB - 14`` tokens, then Qwen2-VL's
    14 special tokens and ``extra`` appended (in that order)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS + list(extra))  # after the trained vocabulary
    return tok


def _write_tokenizer(d: Path, texts: list[str], family: str, processor_class: str,
                     chat_template: str) -> tuple[dict[str, int], int]:
    """tokenizer.json, vocab.json, merges.txt, tokenizer_config.json and
    chat_template.json of ``family``. Returns (special token -> id, vocabulary
    size)."""
    extra = FAMILY_TOKENS[family]
    specials = SPECIAL_TOKENS + extra
    tok = _train_tokenizer(texts, extra)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    ids = {t: tok.token_to_id(t) for t in specials}
    tok.save(str(d / "tokenizer.json"))
    # vocab.json / merges.txt too, as in the hub repo (slow-tokenizer loaders).
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    _write_json(d / "vocab.json", tj["model"]["vocab"])
    merges = tj["model"]["merges"]
    with open(d / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for m in merges:
            f.write((m if isinstance(m, str) else " ".join(m)) + "\n")

    tc = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for t in specials
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                                      "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                                      "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                                      "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                                      "<|video_pad|>", *extra],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "processor_class": processor_class,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if family == "llava-next":
        tc["image_token"] = "<image>"
    _write_json(d / "tokenizer_config.json", tc)
    _write_json(d / "chat_template.json", {"chat_template": chat_template})
    return ids, vocab_size


# -- shared core: weights --------------------------------------------------------------
class _Init:
    """Draws a checkpoint's tensors in a fixed order from one seeded
    generator: ``w`` N(0, INIT_STD), ``zeros`` (biases), ``ones`` (norms)."""

    def __init__(self):
        import torch

        self.torch = torch
        self.g = torch.Generator().manual_seed(SEED)
        self.out: dict = {}

    def w(self, name, *shape):
        self.out[name] = (self.torch.randn(*shape, generator=self.g, dtype=self.torch.float32)
                          * INIT_STD)

    def zeros(self, name, *shape):
        self.out[name] = self.torch.zeros(*shape, dtype=self.torch.float32)

    def ones(self, name, *shape):
        self.out[name] = self.torch.ones(*shape, dtype=self.torch.float32)

    def linear(self, name, n_out, n_in, bias: bool = True):
        self.w(name + ".weight", n_out, n_in)
        if bias:
            self.zeros(name + ".bias", n_out)

    def layer_norm(self, name, n):
        self.ones(name + ".weight", n)
        self.zeros(name + ".bias", n)


def _qwen2_text(init: _Init, t: dict, prefix: str = "") -> None:
    """The Qwen2 decoder of text config ``t`` under ``prefix`` (the hub's
    ``model.*`` + ``lm_head.weight``; ``language_model.`` before both in the
    LLaVA and Qwen2-Audio layouts)."""
    V, H, I = t["vocab_size"], t["hidden_size"], t["intermediate_size"]
    heads, kv_heads = t["num_attention_heads"], t["num_key_value_heads"]
    hd = H // heads
    init.w(prefix + "model.embed_tokens.weight", V, H)
    for i in range(t["num_hidden_layers"]):
        p = f"{prefix}model.layers.{i}."
        init.linear(p + "self_attn.q_proj", heads * hd, H)
        init.linear(p + "self_attn.k_proj", kv_heads * hd, H)
        init.linear(p + "self_attn.v_proj", kv_heads * hd, H)
        init.linear(p + "self_attn.o_proj", H, heads * hd, bias=False)
        init.linear(p + "mlp.gate_proj", I, H, bias=False)
        init.linear(p + "mlp.up_proj", I, H, bias=False)
        init.linear(p + "mlp.down_proj", H, I, bias=False)
        init.ones(p + "input_layernorm.weight", H)
        init.ones(p + "post_attention_layernorm.weight", H)
    init.ones(prefix + "model.norm.weight", H)
    init.w(prefix + "lm_head.weight", V, H)


def _text_fields(ids: dict, vocab_size: int, heads: int) -> dict:
    """Qwen2 text fields (the flat Qwen2-VL layout's top level, or a
    ``text_config``)."""
    return {
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "hidden_act": "silu",
        "hidden_size": HIDDEN * heads // HEADS,
        "initializer_range": INIT_STD,
        "intermediate_size": INTERMEDIATE * heads // HEADS,
        "max_position_embeddings": 32768,
        "max_window_layers": LAYERS,
        "num_attention_heads": heads,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS * heads // HEADS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
    }


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_generation_config(d: Path, ids: dict) -> None:
    _write_json(d / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    })


def _save_weights(d: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def _qwen_image_processor(processor_class: str) -> dict:
    min_pixels, max_pixels = 56 * 56, 28 * 28 * 16384  # Qwen2VLImageProcessor's defaults
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "max_pixels": max_pixels,
        "merge_size": MERGE,
        "min_pixels": min_pixels,
        "patch_size": PATCH,
        "processor_class": processor_class,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
        "temporal_patch_size": TEMPORAL,
    }


# -- qwen2-vl --------------------------------------------------------------------------
def _qwen2_vl_vision(init: _Init, out_hidden: int) -> None:
    E, M = V_EMBED, V_EMBED * V_MLP_RATIO
    init.w("visual.patch_embed.proj.weight", E, IN_CHANS, TEMPORAL, PATCH, PATCH)
    for i in range(V_DEPTH):
        p = f"visual.blocks.{i}."
        for norm in ("norm1", "norm2"):
            init.layer_norm(p + norm, E)
        init.linear(p + "attn.qkv", 3 * E, E)
        init.linear(p + "attn.proj", E, E)
        init.linear(p + "mlp.fc1", M, E)
        init.linear(p + "mlp.fc2", E, M)
    C = E * MERGE * MERGE
    init.layer_norm("visual.merger.ln_q", E)
    init.linear("visual.merger.mlp.0", C, C)
    init.linear("visual.merger.mlp.2", out_hidden, C)


def _qwen_vl_config(arch: str, model_type: str, ids: dict, vocab_size: int, heads: int,
                    vision: dict) -> dict:
    """The flat layout of Qwen2-VL / Qwen2.5-VL's config.json (text fields at
    the top level, in the hub file's order)."""
    t = _text_fields(ids, vocab_size, heads)
    return {
        "architectures": [arch],
        "model_type": model_type,
        "attention_dropout": t["attention_dropout"],
        "bos_token_id": t["bos_token_id"],
        "eos_token_id": t["eos_token_id"],
        "pad_token_id": t["pad_token_id"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        **{k: t[k] for k in ("hidden_act", "hidden_size", "initializer_range",
                             "intermediate_size", "max_position_embeddings",
                             "max_window_layers", "num_attention_heads", "num_hidden_layers",
                             "num_key_value_heads", "rms_norm_eps", "rope_theta")},
        "rope_scaling": {"type": "mrope", "mrope_section": MROPE_SECTION},
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
        "vision_config": vision,
    }


def _build_qwen2_vl(d: Path, texts: list[str], heads: int) -> None:
    ids, vocab_size = _write_tokenizer(d, texts, "qwen2-vl", "Qwen2VLProcessor", CHAT_TEMPLATE)
    _write_json(d / "preprocessor_config.json", _qwen_image_processor("Qwen2VLProcessor"))
    cfg = _qwen_vl_config("Qwen2VLForConditionalGeneration", "qwen2_vl", ids, vocab_size, heads, {
        "depth": V_DEPTH,
        "embed_dim": V_EMBED,
        "hidden_act": "quick_gelu",
        "hidden_size": HIDDEN * heads // HEADS,
        "in_chans": IN_CHANS,
        "in_channels": IN_CHANS,
        "initializer_range": INIT_STD,
        "mlp_ratio": V_MLP_RATIO,
        "num_heads": V_HEADS,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "spatial_patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
    })
    _write_json(d / "config.json", cfg)
    _write_generation_config(d, ids)
    init = _Init()
    _qwen2_text(init, cfg)
    _qwen2_vl_vision(init, cfg["hidden_size"])
    _save_weights(d, init.out)


# -- qwen2.5-vl ------------------------------------------------------------------------
def _qwen2_5_vl_vision(init: _Init, out_hidden: int) -> None:
    E, I = V_EMBED, V25_INTERMEDIATE
    init.w("visual.patch_embed.proj.weight", E, IN_CHANS, TEMPORAL, PATCH, PATCH)
    for i in range(V_DEPTH):
        p = f"visual.blocks.{i}."
        init.ones(p + "norm1.weight", E)  # RMSNorm
        init.ones(p + "norm2.weight", E)
        init.linear(p + "attn.qkv", 3 * E, E)
        init.linear(p + "attn.proj", E, E)
        init.linear(p + "mlp.gate_proj", I, E)
        init.linear(p + "mlp.up_proj", I, E)
        init.linear(p + "mlp.down_proj", E, I)
    C = E * MERGE * MERGE
    init.ones("visual.merger.ln_q.weight", E)  # RMSNorm
    init.linear("visual.merger.mlp.0", C, C)
    init.linear("visual.merger.mlp.2", out_hidden, C)


def _build_qwen2_5_vl(d: Path, texts: list[str], heads: int) -> None:
    ids, vocab_size = _write_tokenizer(d, texts, "qwen2.5-vl", "Qwen2_5_VLProcessor",
                                       CHAT_TEMPLATE)  # Qwen2.5-VL-Instruct's is Qwen2-VL's
    _write_json(d / "preprocessor_config.json", _qwen_image_processor("Qwen2_5_VLProcessor"))
    v_min, v_max = 128 * 28 * 28, 768 * 28 * 28  # Qwen2VLVideoProcessor's defaults
    _write_json(d / "video_preprocessor_config.json", {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "do_sample_frames": False,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "max_frames": 768,
        "max_pixels": v_max,
        "merge_size": MERGE,
        "min_frames": 4,
        "min_pixels": v_min,
        "patch_size": PATCH,
        "processor_class": "Qwen2_5_VLProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": v_max, "shortest_edge": v_min},
        "temporal_patch_size": TEMPORAL,
        "video_processor_type": "Qwen2VLVideoProcessor",
    })
    H = HIDDEN * heads // HEADS
    cfg = _qwen_vl_config("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", ids, vocab_size,
                          heads, {
        "depth": V_DEPTH,
        "hidden_act": "silu",
        "hidden_size": V_EMBED,
        "intermediate_size": V25_INTERMEDIATE,
        "num_heads": V25_HEADS,
        "in_chans": IN_CHANS,
        "in_channels": IN_CHANS,
        "initializer_range": INIT_STD,
        "out_hidden_size": H,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "spatial_patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
        "tokens_per_second": 2,
        "window_size": V25_WINDOW,
        "fullatt_block_indexes": V25_FULLATT,
    })
    _write_json(d / "config.json", cfg)
    _write_generation_config(d, ids)
    init = _Init()
    _qwen2_text(init, cfg)
    _qwen2_5_vl_vision(init, H)
    _save_weights(d, init.out)


# -- llava-next ------------------------------------------------------------------------
def _text_config(ids: dict, vocab_size: int, heads: int) -> dict:
    """A nested Qwen2 ``text_config`` (LLaVA-NeXT, Qwen2-Audio)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **_text_fields(ids, vocab_size, heads),
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _build_llava_next(d: Path, texts: list[str], heads: int) -> None:
    ids, vocab_size = _write_tokenizer(d, texts, "llava-next", "LlavaNextProcessor",
                                       LLAVA_NEXT_CHAT_TEMPLATE)
    _write_json(d / "preprocessor_config.json", {
        "aspect_ratio_setting": "anyres",
        "crop_size": {"height": CLIP_SIZE, "width": CLIP_SIZE},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_grid_pinpoints": GRID_PINPOINTS,
        "image_mean": CLIP_MEAN,
        "image_processor_type": "LlavaNextImageProcessor",
        "image_std": CLIP_STD,
        "processor_class": "LlavaNextProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"shortest_edge": CLIP_SIZE},
    })
    _write_json(d / "processor_config.json", {
        "image_token": "<image>",
        "num_additional_image_tokens": 1,
        "patch_size": PATCH,
        "processor_class": "LlavaNextProcessor",
        "vision_feature_select_strategy": "default",
    })
    text = _text_config(ids, vocab_size, heads)
    H = text["hidden_size"]
    cfg = {
        "architectures": ["LlavaNextForConditionalGeneration"],
        "model_type": "llava_next",
        "ignore_index": -100,
        "image_grid_pinpoints": GRID_PINPOINTS,
        "image_seq_length": (CLIP_SIZE // PATCH) ** 2,
        "image_token_index": ids["<image>"],
        "multimodal_projector_bias": True,
        "projector_hidden_act": "gelu",
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_image_newline_parameter": True,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_act": "quick_gelu",
            "hidden_size": CLIP_EMBED,
            "image_size": CLIP_SIZE,
            "initializer_range": INIT_STD,
            "intermediate_size": CLIP_INTERMEDIATE,
            "layer_norm_eps": 1e-5,
            "num_attention_heads": CLIP_HEADS,
            "num_channels": IN_CHANS,
            "num_hidden_layers": CLIP_LAYERS,
            "patch_size": PATCH,
            "projection_dim": H,
            "vocab_size": vocab_size,
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": vocab_size,
    }
    _write_json(d / "config.json", cfg)
    _write_generation_config(d, ids)
    init = _Init()
    _qwen2_text(init, text, prefix="language_model.")
    E, P = CLIP_EMBED, "vision_tower.vision_model."
    init.w(P + "embeddings.class_embedding", E)
    init.w(P + "embeddings.patch_embedding.weight", E, IN_CHANS, PATCH, PATCH)
    init.w(P + "embeddings.position_embedding.weight", (CLIP_SIZE // PATCH) ** 2 + 1, E)
    init.layer_norm(P + "pre_layrnorm", E)  # sic: CLIP's name
    for i in range(CLIP_LAYERS):
        p = f"{P}encoder.layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            init.linear(p + "self_attn." + proj, E, E)
        init.layer_norm(p + "layer_norm1", E)
        init.linear(p + "mlp.fc1", CLIP_INTERMEDIATE, E)
        init.linear(p + "mlp.fc2", E, CLIP_INTERMEDIATE)
        init.layer_norm(p + "layer_norm2", E)
    init.layer_norm(P + "post_layernorm", E)
    init.linear("multi_modal_projector.linear_1", H, E)
    init.linear("multi_modal_projector.linear_2", H, H)
    init.w("image_newline", H)
    _save_weights(d, init.out)


# -- qwen2-audio -----------------------------------------------------------------------
def _sinusoids(length: int, channels: int, max_timescale: float = 10000.0):
    """Whisper's position table [length, channels] float32."""
    import torch

    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


def _build_qwen2_audio(d: Path, texts: list[str], heads: int) -> None:
    ids, vocab_size = _write_tokenizer(d, texts, "qwen2-audio", "Qwen2AudioProcessor",
                                       QWEN2_AUDIO_CHAT_TEMPLATE)
    _write_json(d / "preprocessor_config.json", {
        "chunk_length": 30,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": A_MELS,
        "hop_length": 160,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "processor_class": "Qwen2AudioProcessor",
        "return_attention_mask": True,
        "sampling_rate": 16000,
    })
    text = _text_config(ids, vocab_size, heads)
    H = text["hidden_size"]
    cfg = {
        "architectures": ["Qwen2AudioForConditionalGeneration"],
        "model_type": "qwen2_audio",
        "audio_config": {
            "model_type": "qwen2_audio_encoder",
            "activation_dropout": 0.0,
            "activation_function": "gelu",
            "attention_dropout": 0.0,
            "d_model": A_DMODEL,
            "dropout": 0.0,
            "encoder_attention_heads": A_HEADS,
            "encoder_ffn_dim": A_FFN,
            "encoder_layerdrop": 0.0,
            "encoder_layers": A_LAYERS,
            "init_std": INIT_STD,
            "max_source_positions": A_POSITIONS,
            "num_hidden_layers": A_LAYERS,
            "num_mel_bins": A_MELS,
            "scale_embedding": False,
        },
        "audio_token_index": ids["<|AUDIO|>"],
        "ignore_index": -100,
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
    }
    _write_json(d / "config.json", cfg)
    _write_generation_config(d, ids)
    init = _Init()
    _qwen2_text(init, text, prefix="language_model.")
    D, A = A_DMODEL, "audio_tower."
    init.w(A + "conv1.weight", D, A_MELS, 3)
    init.zeros(A + "conv1.bias", D)
    init.w(A + "conv2.weight", D, D, 3)
    init.zeros(A + "conv2.bias", D)
    init.out[A + "embed_positions.weight"] = _sinusoids(A_POSITIONS, D)
    for i in range(A_LAYERS):
        p = f"{A}layers.{i}."
        init.linear(p + "self_attn.k_proj", D, D, bias=False)  # Whisper's k_proj has none
        init.linear(p + "self_attn.v_proj", D, D)
        init.linear(p + "self_attn.q_proj", D, D)
        init.linear(p + "self_attn.out_proj", D, D)
        init.layer_norm(p + "self_attn_layer_norm", D)
        init.linear(p + "fc1", A_FFN, D)
        init.linear(p + "fc2", D, A_FFN)
        init.layer_norm(p + "final_layer_norm", D)
    init.layer_norm(A + "layer_norm", D)
    init.linear("multi_modal_projector.linear", H, D)
    _save_weights(d, init.out)


_BUILDERS = {
    "qwen2-vl": _build_qwen2_vl,
    "qwen2.5-vl": _build_qwen2_5_vl,
    "llava-next": _build_llava_next,
    "qwen2-audio": _build_qwen2_audio,
}


def stamp_name(family: str = "qwen2-vl") -> str:
    """The stamp file's name in a built directory of ``family``."""
    return STAMP if family == "qwen2-vl" else f".tiny-{family}-stamp"


def model_dir(family: str = "qwen2-vl") -> Path:
    """Where the e2e tests keep ``family``'s model: ``<repo>/.venvs/tiny-<family>``
    (git-ignored)."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    return Path(__file__).resolve().parents[2] / ".venvs" / f"tiny-{family}"


def build(path: str | os.PathLike, heads: int = HEADS, family: str = "qwen2-vl") -> str:
    """Build the tiny model of ``family`` (one of ``FAMILIES``) into ``path``
    unless a fresh build is already there; returns the directory.

    ``heads``: text attention (and KV) heads, each of 64; the hidden width and
    the MLP grow with them. The default 2 divides TP=2; 4 gives a model TP=4
    can shard (two ranks on each of two nodes). Raises ``ValueError`` for an
    unknown family."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    d = Path(path).resolve()
    texts = _corpus()
    stamp = (_stamp_value(texts) + ("" if family == "qwen2-vl" else f"-{family}")
             + ("" if heads == HEADS else f"-heads{heads}"))
    sp = d / stamp_name(family)
    if sp.is_file() and sp.read_text().strip() == stamp:
        return str(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and swap in, so a crash never leaves a stamped
    # half-built directory and concurrent builders do not interleave files.
    tmp = Path(tempfile.mkdtemp(prefix=d.name + ".build-", dir=d.parent))
    try:
        _BUILDERS[family](tmp, texts, heads)
        (tmp / stamp_name(family)).write_text(stamp + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 / safetensors' 0600: readable by all
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if d.exists():
            old = d.with_name(d.name + f".old-{os.getpid()}")
            d.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.harness.models",
                                 description="Build a tiny random-weight model offline.")
    ap.add_argument("dir")
    ap.add_argument("--family", default="qwen2-vl", choices=FAMILIES)
    ap.add_argument("--heads", type=int, default=HEADS)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    out = build(args.dir, heads=args.heads, family=args.family)
    print(f"{out} ({args.family}) ready in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
