"""Build a tiny random-weight Qwen2-VL checkpoint offline, for the e2e tests.

Why: the e2e tests start the real SGLang and vLLM servers on CPU, with the
real OpenAI client sending real photos, but no model hub can be reached and
these machines have 2 cores. A real Qwen2-VL is neither downloadable nor
runnable here, so this builds one of the same architecture and file layout
as `Qwen/Qwen2-VL-2B-Instruct`, only tiny:

- `config.json`: `Qwen2VLForConditionalGeneration`, in the hub's flat layout
  (text fields at the top level, `vision_config` nested, `rope_scaling`
  `mrope`), which transformers 4.x and 5.x, vLLM and SGLang all read. 2 text
  layers of hidden 128 (2 heads of 64, as TP=2 shards them), 2 vision blocks
  of embed 128 with the real patch_size 14, spatial_merge_size 2,
  temporal_patch_size 2, and a merger whose output width is the text hidden.
  A 720p photo still becomes pixel_values [4784, 1176] float32 (22 MB), so
  the transport carries real-sized tensors; the image takes 1196 tokens.
- A byte-level BPE tokenizer (Qwen2's pre-tokenizer regex) trained with
  `tokenizers` on a fixed set of Python stdlib sources, plus Qwen2-VL's 14
  special tokens appended after it, as in the real vocabulary; their ids go
  into config.json (image/video/vision_start/vision_end/bos/eos) and
  generation_config.json (bos/eos/pad only: no sampling defaults, which the
  servers would apply).
- Qwen2-VL-Instruct's real chat template (tokenizer_config.json and
  chat_template.json, where both transformers generations find it).
- `preprocessor_config.json`: `Qwen2VLImageProcessor` with the default
  min/max_pixels and `processor_class` `Qwen2VLProcessor`, so
  `AutoProcessor.from_pretrained(dir)` works.
- `model.safetensors`: float32 weights drawn from N(0, 0.3) with a fixed seed
  (biases 0, norms 1), under the hub checkpoint's key names (`model.*`,
  `visual.*`, `lm_head.*`). They are written directly with safetensors rather
  than through `save_pretrained`: transformers 4.57 and 5.x lay a model's keys
  out differently, while every loader (both transformers generations, vLLM,
  SGLang) reads the hub layout. The large std makes the outputs depend on the
  pixels: a different photo changes the logprobs.

The build is deterministic and takes a few seconds. It is idempotent: a stamp
file holds a hash of this file's source and of the tokenizer corpus, and a
directory with a matching stamp is reused; a stale or partial one is rebuilt.

    build(path) -> str            # the model directory
    python tests/e2e/tiny_model.py DIR
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

STAMP = ".tiny-qwen2-vl-stamp"
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
# Vision tower: the real patching, a tiny width.
V_DEPTH = 2
V_EMBED = 128
V_HEADS = 4
V_MLP_RATIO = 4
PATCH = 14
MERGE = 2
TEMPORAL = 2
IN_CHANS = 3
# Tokenizer: trained tokens + 14 special tokens = VOCAB.
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


def _train_tokenizer(texts: list[str]):
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
    tok.add_special_tokens(SPECIAL_TOKENS)  # appended after the trained vocabulary
    return tok


def _weights(cfg: dict) -> dict:
    import torch

    g = torch.Generator().manual_seed(SEED)
    out: dict[str, torch.Tensor] = {}

    def w(name, *shape):
        out[name] = torch.randn(*shape, generator=g, dtype=torch.float32) * INIT_STD

    def zeros(name, *shape):
        out[name] = torch.zeros(*shape, dtype=torch.float32)

    def ones(name, *shape):
        out[name] = torch.ones(*shape, dtype=torch.float32)

    V, H, I = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    HEADS, KV_HEADS = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = H // HEADS
    w("model.embed_tokens.weight", V, H)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w(p + "self_attn.q_proj.weight", HEADS * hd, H)
        zeros(p + "self_attn.q_proj.bias", HEADS * hd)
        w(p + "self_attn.k_proj.weight", KV_HEADS * hd, H)
        zeros(p + "self_attn.k_proj.bias", KV_HEADS * hd)
        w(p + "self_attn.v_proj.weight", KV_HEADS * hd, H)
        zeros(p + "self_attn.v_proj.bias", KV_HEADS * hd)
        w(p + "self_attn.o_proj.weight", H, HEADS * hd)
        w(p + "mlp.gate_proj.weight", I, H)
        w(p + "mlp.up_proj.weight", I, H)
        w(p + "mlp.down_proj.weight", H, I)
        ones(p + "input_layernorm.weight", H)
        ones(p + "post_attention_layernorm.weight", H)
    ones("model.norm.weight", H)
    w("lm_head.weight", V, H)

    E, M = V_EMBED, V_EMBED * V_MLP_RATIO
    w("visual.patch_embed.proj.weight", E, IN_CHANS, TEMPORAL, PATCH, PATCH)
    for i in range(V_DEPTH):
        p = f"visual.blocks.{i}."
        for norm in ("norm1", "norm2"):
            ones(p + norm + ".weight", E)
            zeros(p + norm + ".bias", E)
        w(p + "attn.qkv.weight", 3 * E, E)
        zeros(p + "attn.qkv.bias", 3 * E)
        w(p + "attn.proj.weight", E, E)
        zeros(p + "attn.proj.bias", E)
        w(p + "mlp.fc1.weight", M, E)
        zeros(p + "mlp.fc1.bias", M)
        w(p + "mlp.fc2.weight", E, M)
        zeros(p + "mlp.fc2.bias", E)
    C = E * MERGE * MERGE
    ones("visual.merger.ln_q.weight", E)
    zeros("visual.merger.ln_q.bias", E)
    w("visual.merger.mlp.0.weight", C, C)
    zeros("visual.merger.mlp.0.bias", C)
    w("visual.merger.mlp.2.weight", H, C)
    zeros("visual.merger.mlp.2.bias", H)
    return out


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _build_into(d: Path, texts: list[str], heads: int = HEADS) -> None:
    tok = _train_tokenizer(texts)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(str(d / "tokenizer.json"))
    # vocab.json / merges.txt too, as in the hub repo (slow-tokenizer loaders).
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    _write_json(d / "vocab.json", tj["model"]["vocab"])
    merges = tj["model"]["merges"]
    with open(d / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for m in merges:
            f.write((m if isinstance(m, str) else " ".join(m)) + "\n")

    _write_json(d / "tokenizer_config.json", {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                                      "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                                      "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                                      "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                                      "<|video_pad|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "processor_class": "Qwen2VLProcessor",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    })
    _write_json(d / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    min_pixels, max_pixels = 56 * 56, 28 * 28 * 16384  # Qwen2VLImageProcessor's defaults
    _write_json(d / "preprocessor_config.json", {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "max_pixels": max_pixels,
        "merge_size": MERGE,
        "min_pixels": min_pixels,
        "patch_size": PATCH,
        "processor_class": "Qwen2VLProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
        "temporal_patch_size": TEMPORAL,
    })

    cfg = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
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
        "rope_scaling": {"type": "mrope", "mrope_section": MROPE_SECTION},
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
        "vision_config": {
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
        },
    }
    _write_json(d / "config.json", cfg)
    _write_json(d / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    })

    from safetensors.torch import save_file

    save_file(_weights(cfg), str(d / "model.safetensors"), metadata={"format": "pt"})


def build(path: str | os.PathLike, heads: int = HEADS) -> str:
    """Build the tiny Qwen2-VL into `path` unless a fresh build is already there.

    ``heads``: text attention (and KV) heads, each of 64; the hidden width and
    the MLP grow with them. The default 2 divides TP=2; 4 gives a model TP=4
    can shard (two ranks on each of two nodes)."""
    d = Path(path).resolve()
    texts = _corpus()
    stamp = _stamp_value(texts) + ("" if heads == HEADS else f"-heads{heads}")
    sp = d / STAMP
    if sp.is_file() and sp.read_text().strip() == stamp:
        return str(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and swap in, so a crash never leaves a stamped
    # half-built directory and concurrent builders do not interleave files.
    tmp = Path(tempfile.mkdtemp(prefix=d.name + ".build-", dir=d.parent))
    try:
        _build_into(tmp, texts, heads)
        (tmp / STAMP).write_text(stamp + "\n")
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
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python tests/e2e/tiny_model.py DIR", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = build(argv[0])
    print(f"{out} ready in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
