"""The vision path: preprocessing, the MoonViT tower in both variants, loading, and the pixel limit.

References: transformers 5.23's kimi_k25 (image processor and K2.5 tower) through the committed
fixture tests/fixtures/kimi_k25_vision.npz, and a NumPy MoonViT written from vLLM 0.33
(tests/k3jax/moonvit_reference.py) for the K3 variant. Everything in fp32, relative error 1e-4.
"""

import io
import json
import pathlib
import struct
import zlib

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from PIL import Image
from safetensors.numpy import load_file, save_file

from convert import synth
from convert.vision_layout import vision_arrays, vision_rules
from k3jax.config import ConfigError, K3Config
from k3jax.presets import PRESETS
from k3jax.vision.config import ImageProcessorConfig, VisionConfig, vision_config
from k3jax.vision.encoder import VisionEncoder, encoder_from_arrays, load_vision_encoder
from k3jax.vision.preprocess import PreparedImage, decode_image, num_image_tokens, prepare
from k3jax.vision.tower import patch_bucket, patch_layout
from sharding.mesh import make_mesh
from tests.k3jax import moonvit_reference

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "kimi_k25_vision.npz"
# transformers resizes with torchvision, we with Pillow (the checkpoint processor's): on a resized
# image they round some pixels one 8-bit level apart, one level being 1 / (255 * std) once normalised.
RESIZED = ("rgb_200x150", "rgb_280x28")


def rel_err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def k25():
    z = np.load(FIXTURE)
    meta = json.loads(bytes(z["config"]).decode())
    tensors = {k[2:]: z[k] for k in z.files if k.startswith("w/")}
    vcfg = VisionConfig.from_hf_dict(meta["vision_config"], k3=False, text_hidden_size=meta["text_hidden_size"])
    processor = ImageProcessorConfig.from_dict(meta["media_proc_cfg"])
    arrays = vision_arrays(vcfg, set(tensors), lambda rule: tensors[rule.name])
    return z, meta, tensors, encoder_from_arrays(vcfg, processor, arrays, dtype="float32")


def test_k25_config_picks_the_k25_variant(k25):
    cfg = k25[3].config
    assert (cfg.norm_type, cfg.norm_eps, cfg.pos_interpolation, cfg.projector_type) == \
        ("layernorm", 1e-5, "bicubic", "patchmerger")
    assert cfg.attn_bias and cfg.linear_bias and cfg.patch_embed_bias and cfg.qkv_size == cfg.hidden_size


@pytest.mark.parametrize("name", ["rgb_84x56", "rgb_45x31", "rgba_70x40", "rgb_200x150", "rgb_280x28"])
def test_preprocessing_matches_transformers(k25, name):
    z, _, _, encoder = k25
    pixels = z[f"image/{name}"]
    prepared = prepare(Image.fromarray(pixels), encoder.processor)
    reference = z[f"pixel_values/{name}"]
    grid = tuple(int(v) for v in z[f"grid/{name}"][1:])
    assert prepared.grid_hw == grid and prepared.pixel_values.shape == reference.shape
    assert prepared.size == (pixels.shape[1], pixels.shape[0])
    assert num_image_tokens(*prepared.size, encoder.processor) == grid[0] * grid[1] // 4
    if name in RESIZED:
        level = 1 / (255 * min(encoder.processor.image_std))
        differ = np.abs(prepared.pixel_values - reference) > 1e-5
        assert np.abs(prepared.pixel_values - reference).max() <= level * 1.001 and differ.mean() < 0.01
    else:  # not resized: padding, the alpha composite and normalisation agree to rounding
        assert rel_err(prepared.pixel_values, reference) < 1e-6


@pytest.mark.parametrize("name", ["rgb_84x56", "rgb_45x31", "rgba_70x40", "rgb_200x150", "rgb_280x28"])
def test_k25_tower_matches_transformers(k25, name):
    z, _, _, encoder = k25
    grid = tuple(int(v) for v in z[f"grid/{name}"][1:])
    features = encoder.encode(PreparedImage(z[f"pixel_values/{name}"], grid, (0, 0)))
    assert rel_err(features, z[f"features/{name}"]) < 1e-4


def test_reference_matches_transformers_on_k25(k25):
    """The NumPy reference is itself checked against transformers before it judges the K3 variant."""
    z, meta, tensors, _ = k25
    vc = dict(norm_type="layernorm", num_heads=2, interpolation="bicubic", rope_theta=1e4, projector="patchmerger")
    for name in meta["images"]:
        grid = tuple(int(v) for v in z[f"grid/{name}"][1:])
        features = moonvit_reference.features(tensors, vc, z[f"pixel_values/{name}"], grid)
        assert rel_err(features, z[f"features/{name}"]) < 1e-5


@pytest.fixture(scope="module")
def k3_tiny():
    cfg = K3Config.from_hf_dict(PRESETS["k3-tiny"])
    tensors = {k: v.astype(np.float32) for k, v in synth.vision_tensors(cfg, np.random.default_rng(3)).items()}
    vcfg = vision_config(cfg)
    arrays = vision_arrays(vcfg, set(tensors), lambda rule: tensors[rule.name])
    return vcfg, tensors, encoder_from_arrays(vcfg, ImageProcessorConfig(), arrays, dtype="float32")


def test_k3_config_picks_the_k3_variant(k3_tiny):
    cfg = k3_tiny[0]
    assert (cfg.norm_type, cfg.norm_eps, cfg.pos_interpolation, cfg.projector_type) == \
        ("rmsnorm", None, "bilinear", "patchmergerv2")
    assert not (cfg.attn_bias or cfg.linear_bias or cfg.patch_embed_bias)
    assert (cfg.qkv_size, cfg.hidden_size, cfg.head_dim, cfg.text_hidden_size) == (48, 32, 24, 64)
    full = VisionConfig.from_hf_dict({}, k3=True, text_hidden_size=7168)  # K3's defaults
    assert (full.num_layers, full.hidden_size, full.num_heads, full.qkv_size, full.intermediate_size) == \
        (27, 1024, 12, 1536, 4096)


@pytest.mark.parametrize("key, value", [("merge_type", "conv"), ("activation_func", "quick_gelu"),
                                        ("norm_type", "batchnorm"), ("qkv_hidden_size", 50)])
def test_unsupported_vision_configs_are_named(key, value):
    with pytest.raises(ConfigError, match=key if key != "qkv_hidden_size" else "qkv width 50"):
        VisionConfig.from_hf_dict({key: value}, k3=True, text_hidden_size=64)


@pytest.mark.parametrize("grid", [(8, 8), (4, 6), (12, 10)])  # the table's own size, smaller, larger
def test_k3_tower_matches_numpy_reference(k3_tiny, grid):
    vcfg, tensors, encoder = k3_tiny
    pixels = np.random.default_rng(grid[0]).uniform(-1, 1, (grid[0] * grid[1], 3, 14, 14)).astype(np.float32)
    features = encoder.encode(PreparedImage(pixels, grid, (0, 0)))
    vc = dict(norm_type="rmsnorm", num_heads=vcfg.num_heads, interpolation="bilinear", rope_theta=1e4,
              projector="patchmergerv2")
    reference = moonvit_reference.features(tensors, vc, pixels, grid)
    assert features.shape == (grid[0] * grid[1] // 4, 64)
    assert rel_err(features, reference) < 1e-4


def test_the_tower_at_a_small_attention_block_matches_the_reference(k3_tiny):
    """120 patches in a bucket of 128, attended in blocks of 24: the image's keys end inside the fifth
    block, and the sixth is padding alone."""
    vcfg, tensors, encoder = k3_tiny
    grid = (12, 10)
    pixels = np.random.default_rng(4).uniform(-1, 1, (120, 3, 14, 14)).astype(np.float32)
    rows = patch_bucket(120)
    padded = np.zeros((rows, 3, 14, 14), np.float32)
    padded[:120] = pixels
    layout = patch_layout(vcfg, grid, rows)
    tower = nnx.merge(encoder.graphdef, encoder.params)
    features = np.asarray(tower(padded, layout, attention_block=24))[:30]
    vc = dict(norm_type="rmsnorm", num_heads=vcfg.num_heads, interpolation="bilinear", rope_theta=1e4,
              projector="patchmergerv2")
    assert rel_err(features, moonvit_reference.features(tensors, vc, pixels, grid)) < 1e-4
    assert rel_err(features, encoder.encode(PreparedImage(pixels, grid, (0, 0)))) < 1e-5  # one block of 1024


def test_bf16_tower_tracks_fp32(k3_tiny):
    """bf16 runs the same tower (its RMSNorms at bf16's epsilon, 2^-7) within bf16 rounding of fp32."""
    vcfg = k3_tiny[0]
    pixels = np.random.default_rng(5).uniform(-1, 1, (24, 3, 14, 14)).astype(np.float32)
    image = PreparedImage(pixels, (4, 6), (0, 0))
    fp32, bf16 = (VisionEncoder.random(vcfg, dtype=d, seed=1).encode(image) for d in ("float32", "bfloat16"))
    assert rel_err(bf16, fp32) < 5e-2


def test_token_counts_for_k25_defaults():
    cfg = ImageProcessorConfig()
    counts = {size: num_image_tokens(*size, cfg) for size in [(1920, 1080), (4000, 3000), (640, 480), (224, 224),
                                                                (100, 30)]}
    assert counts == {(1920, 1080): 2691, (4000, 3000): 4200, (640, 480): 414, (224, 224): 64, (100, 30): 8}


def _encoded(pixels, fmt, **kw):
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_decodes_png_jpeg_webp_and_the_first_gif_frame():
    cfg = ImageProcessorConfig()
    pixels = np.random.default_rng(0).integers(0, 256, (30, 40, 3), np.uint8)
    for fmt, kw in (("PNG", {}), ("WEBP", {"lossless": True})):
        np.testing.assert_array_equal(np.asarray(decode_image(_encoded(pixels, fmt, **kw), cfg).convert("RGB")), pixels)
    jpeg = np.asarray(decode_image(_encoded(pixels, "JPEG", quality=95), cfg))
    assert jpeg.shape == pixels.shape
    frames = [Image.new("RGB", (20, 10), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:])
    prepared = prepare(gif.getvalue(), cfg)
    assert prepared.grid_hw == (2, 2) and prepared.size == (20, 10)
    assert np.allclose(prepared.pixel_values[0, :, 0, 0], [1, -1, -1])  # red: the first frame


def _png_header(width, height):
    """A PNG that declares width x height and holds almost no data (a decompression-bomb shape)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_pixel_limit_is_checked_before_decoding():
    cfg = ImageProcessorConfig(max_pixels=1_000_000)
    with pytest.raises(ValueError, match=r"12000x12000 = 144000000 pixels, over the limit of 1000000 pixels"):
        prepare(_png_header(12_000, 12_000), cfg)
    with pytest.raises(ValueError, match=r"over the limit of 1000000 pixels per image \(max_pixels\)"):
        prepare(_png_header(100_000, 100_000), cfg)  # past Pillow's own bomb limit too
    with pytest.raises(ValueError, match="max_pixels"):
        prepare(Image.new("RGB", (1001, 1000)), cfg)
    assert prepare(Image.new("RGB", (1000, 1000)), cfg).grid_hw == (72, 72)


@pytest.mark.parametrize("data, message", [(b"not an image at all", "not an image"),
                                           (_png_header(64, 64)[:40], "cannot be decoded|not an image")])
def test_bad_image_bytes_raise_value_errors(data, message):
    with pytest.raises(ValueError, match=message):
        prepare(data, ImageProcessorConfig())


CHESSBOARD = np.array([[255, 255, 200, 200]] * 2 + [[200, 200, 255, 255]] * 2)  # square 2, white top left


@pytest.mark.parametrize("bg, background", [
    (None, None), ({"pattern": "white"}, 255), ({"pattern": "black"}, 0), ({"pattern": "gray"}, 128),
    ({"pattern": "chessboard", "chessboard_square_size": 2}, CHESSBOARD),
])
def test_alpha_is_composited_onto_the_configured_background(bg, background):
    rgba = np.random.default_rng(1).integers(0, 256, (4, 4, 4), np.uint8)
    cfg = ImageProcessorConfig(transparent_bg_config=bg, image_mean=(0, 0, 0), image_std=(1, 1, 1))
    out = prepare(Image.fromarray(rgba, "RGBA"), cfg).pixel_values[0].transpose(1, 2, 0)[:4, :4] * 255
    rgb, alpha = rgba[..., :3].astype(np.float32), rgba[..., 3:].astype(np.float32) / 255
    if bg is None:  # no background configured: alpha dropped
        expected = rgb
    else:
        expected = np.floor(alpha * rgb + (1 - alpha) * np.broadcast_to(np.float32(background), (4, 4))[..., None])
    np.testing.assert_allclose(out, expected, atol=1e-3)


def test_k3_tiny_checkpoint_vision_round_trip(tmp_path):
    cfg = synth.write_checkpoint(tmp_path, PRESETS["k3-tiny"], seed=2)
    encoder = load_vision_encoder(tmp_path, cfg, dtype="float32")
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert {r.name for r in vision_rules(encoder.config)} == {n for n in stored if n.startswith(("vision_", "mm_"))}
    block = encoder.params["blocks"][1]
    np.testing.assert_array_equal(np.asarray(block["wqkv"]["kernel"][...]),
                                  stored["vision_tower.encoder.blocks.1.wqkv.weight"].astype(np.float32).T)
    np.testing.assert_array_equal(np.asarray(encoder.params["patch_embed"]["kernel"][...]),
                                  stored["vision_tower.patch_embed.proj.weight"].astype(np.float32).reshape(32, -1).T)
    pixels = np.random.default_rng(0).integers(0, 256, (50, 60, 3), np.uint8)
    features = encoder.encode(_encoded(pixels, "PNG"))
    assert features.shape == (6, cfg.hidden_size) and np.isfinite(features).all()
    sharded = load_vision_encoder(tmp_path, cfg, dtype="float32", mesh=make_mesh("8x2"))  # replicated
    assert sharded.params["blocks"][0]["fc0"]["kernel"][...].sharding.is_fully_replicated
    np.testing.assert_array_equal(sharded.encode(_encoded(pixels, "PNG")), features)
    # A checkpoint without vision tensors (or a text-only config) gives no encoder.
    text_only = {n: v for n, v in stored.items() if not n.startswith(("vision_", "mm_"))}
    (tmp_path / "text").mkdir()
    save_file(text_only, str(tmp_path / "text" / "model.safetensors"))
    assert load_vision_encoder(tmp_path / "text", cfg) is None
    broken = {**stored, "vision_tower.encoder.blocks.1.wo.weight": np.zeros((3, 3), ml_dtypes.bfloat16)}
    (tmp_path / "bad").mkdir()
    save_file(broken, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"blocks.1.wo.weight has shape \(3, 3\), expected \(32, 48\)"):
        load_vision_encoder(tmp_path / "bad", cfg)


def test_image_sizes_of_one_patch_bucket_share_one_program(k3_tiny):
    """Grids of 20 and 24 patches (three shapes) run padded to the 24-patch bucket: one compile, and
    each still matches the reference (the padding masked out of attention, the merge order by grid)."""
    from k3jax.vision.encoder import _encode
    from k3jax.vision.tower import patch_bucket

    vcfg, tensors, encoder = k3_tiny
    assert [patch_bucket(n) for n in (1, 16, 17, 20, 24, 25, 48, 49, 16384)] == [16, 16, 24, 24, 24, 32, 48, 64, 16384]
    vc = dict(norm_type="rmsnorm", num_heads=vcfg.num_heads, interpolation="bilinear", rope_theta=1e4,
              projector="patchmergerv2")
    compiled = None
    for grid in ((4, 6), (6, 4), (2, 10)):
        pixels = np.random.default_rng(sum(grid)).uniform(-1, 1, (grid[0] * grid[1], 3, 14, 14)).astype(np.float32)
        features = encoder.encode(PreparedImage(pixels, grid, (0, 0)))
        assert rel_err(features, moonvit_reference.features(tensors, vc, pixels, grid)) < 1e-4
        compiled = _encode._cache_size() if compiled is None else compiled
    assert _encode._cache_size() == compiled
