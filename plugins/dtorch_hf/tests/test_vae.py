"""The VAE (diffusers' AutoencoderKL, unmodified) on a mesh against the same model on the
controller: encode, decode and forward with the batch split over "dp" (uneven, and empty
shards on dp=4), both runners; no replicated fallback; tp/sp/cfg refused or replicated over."""

from __future__ import annotations

import dtorch_hf
import pytest
import torch

import dtorch_core as dt

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKL
from diffusers.utils import logging as diffusers_logging
from hf_testing import rel_err

# two down/up blocks of 8 and 16 channels (one downsample, one nearest upsample), 4 groups per
# group norm, the mid block's attention; "sd" with the quant convs (SD 1.x/2.x/XL), "flux"
# without them (the SD3 and Flux VAEs)
BASE = {"in_channels": 3, "out_channels": 3, "block_out_channels": (8, 16), "layers_per_block": 1,
        "down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2,
        "norm_num_groups": 4, "sample_size": 16}
CONFIGS = {
    "sd": {**BASE, "latent_channels": 4},
    "flux": {**BASE, "latent_channels": 8, "use_quant_conv": False, "use_post_quant_conv": False},
}
# dp over all four devices (a batch of 3: shards 1/1/1/0), and a pipeline's (dp, sp) mesh: the
# VAE replicated over "sp" (unused_dims="replicate"), the batch split 2/1 over "dp"
MESHES = {"dp4": ((4,), ("dp",)), "dp2xsp2": ((2, 2), ("dp", "sp"))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    diffusers_logging.set_verbosity_error()       # "accelerate not found" on every load
    out = {}
    for kind, config in CONFIGS.items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(f"vae-{kind}")
        AutoencoderKL(**config).save_pretrained(path)
        out[kind] = path
    return out


def _pair(path):
    return AutoencoderKL.from_pretrained(path).eval(), AutoencoderKL.from_pretrained(path).eval()


def _mesh(name):
    shape, names = MESHES[name]
    return dt.init_device_mesh("cpu", shape, mesh_dim_names=names)


def _images(batch, h=12, w=10):
    # 12 x 10: the downsample's asymmetric pad, and a non-square latent (6 x 5)
    return torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(1))


def _dp_shard(x, mesh):
    return x.placements[mesh.mesh_dim_names.index("dp")] == dt.Shard(0)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_encode_decode_match(session, saved, mesh_name, kind):
    ref, model = _pair(saved[kind])
    mesh = _mesh(mesh_name)
    assert dtorch_hf.parallelize(model, mesh, unused_dims="replicate") is model
    assert all(p.placements == (dt.Replicate(),) * mesh.ndim for p in model.parameters())
    x = _images(3)
    with torch.no_grad():
        got, want = model.encode(x).latent_dist, ref.encode(x).latent_dist
        assert _dp_shard(got.mean, mesh)
        assert rel_err(got.mean, want.mean) <= 1e-4
        assert rel_err(got.logvar, want.logvar) <= 1e-4
        noise = [torch.Generator().manual_seed(2) for _ in range(2)]
        assert rel_err(got.sample(noise[0]), want.sample(noise[1])) <= 1e-4
        z = torch.randn(3, CONFIGS[kind]["latent_channels"], 6, 5, generator=torch.Generator().manual_seed(3))
        decoded, want_decoded = model.decode(z).sample, ref.decode(z).sample
        assert _dp_shard(decoded, mesh) and tuple(decoded.shape) == (3, 3, 12, 10)
        assert rel_err(decoded, want_decoded) <= 1e-4
        # forward: encode, the posterior's mode, decode; and decode of a batch-split latent
        assert rel_err(model(x).sample, ref(x).sample) <= 1e-4
        assert rel_err(model.decode(got.mode()).sample, ref.decode(want.mode()).sample) <= 1e-4
    assert not dt.fallback_counts(), dt.fallback_counts()


def test_even_batch_moves_nothing(session, saved):
    """A batch of 4 on dp=4: encode and decode run wholly on each worker's image (every
    convolution, group norm, upsampling and the mid-block attention a local call). A batch of
    3 adds all-gathers where the attention flattens (batch, pixels) of an uneven shard (the
    same core gap as the text models' uneven dp batch)."""
    ref, model = _pair(saved["sd"])
    dtorch_hf.parallelize(model, _mesh("dp4"))
    x = _images(4)
    with torch.no_grad(), dt.debug.comm_mode() as comm:
        decoded = model(x).sample
    assert comm.total() == 0, comm.counts_by_op()
    with torch.no_grad():
        assert rel_err(decoded, ref(x).sample) <= 1e-4
    assert not dt.fallback_counts(), dt.fallback_counts()


@pytest.mark.parametrize("dim", ["tp", "sp", "cfg"])
def test_refuses_other_dims(session, saved, dim):
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", dim))
    with pytest.raises(dtorch_hf.UnsupportedMeshDimError, match=f"'{dim}'.*not supported for AutoencoderKL"):
        dtorch_hf.parallelize(AutoencoderKL.from_pretrained(saved["sd"]), mesh)
