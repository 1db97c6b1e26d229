"""Generate an image with Stable Diffusion 3 on a dtorch mesh, the weights loaded straight into
shards by ``dtorch_hf.from_pretrained``, and write it as a PNG.

    python examples/sd3_generate.py --tiny --cfg 2 --sp 2          # a tiny random pipeline, runs anywhere
    python examples/sd3_generate.py --model-dir DIR --tp 2 --sp 2  # a local SD3 pipeline directory

--cfg 2 puts the conditional and unconditional halves of the CFG batch on different devices;
--tp, --sp and --cfg combine (the world size is their product).

Nothing is downloaded. With --tiny the image is compared with diffusers' pipeline on one device.
"""

from __future__ import annotations

from diffusion_generate import main

if __name__ == "__main__":
    raise SystemExit(main("sd3", __doc__.splitlines()[0]))
