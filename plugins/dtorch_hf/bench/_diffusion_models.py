"""The models and inputs of bench/hf_models.py: Flux- and SD3-shaped diffusers transformers with
random weights, one denoising step's inputs, and the two ways of building them.

Shapes follow the released checkpoints' configs (nothing is downloaded):
- ``flux``: FLUX.1-dev's ``FluxTransformer2DModel`` (19 double- + 38 single-stream blocks, 24
  heads of 128, joint_attention_dim 4096, pooled_projection_dim 768, in_channels 64, guidance
  embedding, RoPE axes 16+56+56). At 1024x1024 the VAE's 128x128 latent is packed 2x2 into 4096
  tokens of 64 channels; the text is T5's 512 tokens (the Flux pipelines' max_sequence_length).
- ``sd3``: SD3-medium's ``SD3Transformer2DModel`` (24 joint blocks, 24 heads of 64,
  joint_attention_dim 4096, caption_projection_dim 1536, pooled_projection_dim 2048, in_channels
  16, patch 2, pos_embed_max_size 192). The latent is (16, 128, 128), 4096 patches; the text is
  333 tokens, what StableDiffusion3Pipeline makes by default (77 CLIP tokens, whose two
  encoders' features are concatenated, then 256 T5 tokens).

Sizes: ``full`` (the real depth) and ``cut`` (4 blocks: Flux 2 double + 2 single, SD3 4 joint
blocks; the same widths). ``--tiny`` keeps the depths and shrinks widths and token counts, for
the CPU.

Values: every weight matrix (and buffer) is N(0, 0.02), every other weight 1 and every bias 0,
drawn where the tensor lives: the diffusers model is built on the meta device and created
uninitialised on its device (``to_empty``), the dtorch model is built on the meta device and
laid out by ``dtorch_hf.parallelize`` as uninitialised shards on the workers
(``meta_as_uninitialised``); both are then filled in place. Nothing crosses from the controller
but the (small) inputs. The two models' values differ (different random streams); their shapes
are equal.
"""

from __future__ import annotations

import torch

STD = 0.02

FLUX_FULL = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
             "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
             "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": (16, 56, 56)}
SD3_FULL = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
            "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
            "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 192}
# --tiny: the same depths, widths a CPU runs in seconds
FLUX_TINY = dict(FLUX_FULL, in_channels=16, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                 pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
SD3_TINY = dict(SD3_FULL, sample_size=16, in_channels=8, out_channels=8, attention_head_dim=8, num_attention_heads=4,
                joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, pos_embed_max_size=16)
CUT_BLOCKS = {"flux": {"num_layers": 2, "num_single_layers": 2}, "sd3": {"num_layers": 4}}
SIZES = ("full", "cut")
MODELS = ("flux", "sd3")
# image latent side (in latent pixels, before patching) and text tokens
TOKENS = {"flux": {"latent": 128, "text": 512}, "sd3": {"latent": 128, "text": 333}}
TINY_TOKENS = {"flux": {"latent": 16, "text": 16}, "sd3": {"latent": 16, "text": 12}}


def model_class(name: str):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    return {"flux": FluxTransformer2DModel, "sd3": SD3Transformer2DModel}[name]


def config(name: str, size: str, *, tiny: bool = False) -> dict:
    base = {"flux": FLUX_TINY if tiny else FLUX_FULL, "sd3": SD3_TINY if tiny else SD3_FULL}[name]
    return dict(base, **CUT_BLOCKS[name]) if size == "cut" else dict(base)


def tokens(name: str, *, tiny: bool = False, text: int | None = None) -> dict:
    out = dict((TINY_TOKENS if tiny else TOKENS)[name])
    if text is not None:
        out["text"] = text
    return out


def parameter_count(cfg: dict, name: str) -> int:
    with torch.device("meta"):
        model = model_class(name)(**cfg)
    return sum(p.numel() for p in model.parameters())


def make_inputs(name: str, cfg: dict, toks: dict, batch: int, dtype, seed: int = 0) -> dict:
    """One denoising step's transformer inputs as the diffusers pipelines build them (plain CPU
    tensors; the latents are noise, the text embeddings random)."""
    g = torch.Generator().manual_seed(seed)
    side, text = toks["latent"], toks["text"]

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if name == "flux":
        h = w = side // 2  # FluxPipeline packs 2x2 latent pixels into one token of 4 x 16 channels
        img_ids = torch.zeros(h, w, 3)
        img_ids[..., 1] = torch.arange(h)[:, None]
        img_ids[..., 2] = torch.arange(w)[None, :]
        return {"hidden_states": randn(batch, h * w, cfg["in_channels"]),
                "encoder_hidden_states": randn(batch, text, cfg["joint_attention_dim"]),
                "pooled_projections": randn(batch, cfg["pooled_projection_dim"]),
                "timestep": torch.full((batch,), 0.5, dtype=dtype),  # the pipeline passes t / 1000
                "img_ids": img_ids.reshape(-1, 3).to(dtype), "txt_ids": torch.zeros(text, 3, dtype=dtype),
                "guidance": torch.full((batch,), 3.5, dtype=dtype)}
    return {"hidden_states": randn(batch, cfg["in_channels"], side, side),
            "encoder_hidden_states": randn(batch, text, cfg["joint_attention_dim"]),
            "pooled_projections": randn(batch, cfg["pooled_projection_dim"]),
            "timestep": torch.full((batch,), 500.0, dtype=dtype)}


def image_tokens(toks: dict) -> int:
    return (toks["latent"] // 2) ** 2  # Flux packs 2x2 latent pixels into a token, SD3 patches 2x2


@torch.no_grad()
def fill_random(model: torch.nn.Module) -> None:
    """Give every parameter and buffer values in place (plain tensors and DTensors alike: the
    in-place random op runs where the tensor lives)."""
    buffers = dict(model.named_buffers())
    for name, t in list(model.named_parameters()) + list(buffers.items()):
        if t.ndim >= 2 or name in buffers:
            t.normal_(0.0, STD)
        elif name.endswith("bias"):
            t.zero_()
        else:
            t.fill_(1.0)


def _on_meta(name: str, cfg: dict, dtype) -> torch.nn.Module:
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # "modules to keep in float32: []" on every cast
    with torch.device("meta"):
        model = model_class(name)(**cfg)
    return model.to(dtype).eval()


def build_diffusers(name: str, cfg: dict, dtype, device: str) -> torch.nn.Module:
    """The plain diffusers model, created directly on ``device`` and filled there."""
    model = _on_meta(name, cfg, dtype).to_empty(device=device)
    fill_random(model)
    return model


def build_dtorch(name: str, cfg: dict, dtype, mesh, sp_mode: str) -> torch.nn.Module:
    """The diffusers model parallelized by ``dtorch_hf.parallelize`` over ``mesh``, its shards
    created and filled on the workers."""
    import dtorch_hf

    from dtorch_core.api import meta_as_uninitialised

    model = _on_meta(name, cfg, dtype)
    with meta_as_uninitialised():
        dtorch_hf.parallelize(model, mesh, sp_mode=sp_mode)
    fill_random(model)
    return model


def place_inputs(inputs: dict, mesh) -> dict:
    """The inputs on the mesh before the timed steps (a pipeline's latents and text embeddings
    live on the devices between steps), replicated: the family's entry hooks lay them out over
    "sp", "cfg" and "dp" (from a replicated DTensor that is a local slice on each worker)."""
    import dtorch_core as dt

    return {k: dt.distribute_tensor(v, mesh, [dt.Replicate()] * mesh.ndim) for k, v in inputs.items()}


def diffusers_step(name: str, cfg: dict, inputs: dict, dtype, device: str):
    """One denoising step of a plain diffusers model built here (a no-grad call on ``inputs``)."""
    model = build_diffusers(name, cfg, dtype, device)
    on_device = {k: v.to(device) for k, v in inputs.items()}

    def step():
        with torch.no_grad():
            return model(**on_device, return_dict=False)[0]

    return step


def dtorch_step(name: str, cfg: dict, inputs: dict, dtype, mesh, sp_mode: str = "ulysses"):
    """One denoising step of the model parallelized over ``mesh`` (inputs placed as
    :func:`place_inputs` places them)."""
    model = build_dtorch(name, cfg, dtype, mesh, sp_mode)
    placed = place_inputs(inputs, mesh)

    def step():
        with torch.no_grad():
            return model(**placed, return_dict=False)[0]

    return step


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """``dst``'s parameters and buffers set to ``src``'s (DTensors read whole): the check that
    both sides compute the same function (small models only: everything crosses the controller)."""
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in src.state_dict().items()}
    dst.load_state_dict({k: v.to(next(dst.parameters()).device) for k, v in state.items()})
