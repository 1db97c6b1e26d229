"""Generate an image with Flux on a dtorch mesh, the weights loaded straight into shards by
``dtorch_hf.from_pretrained``, and write it as a PNG.

    python examples/flux_generate.py --tiny --tp 2 --sp 2           # a tiny random pipeline, runs anywhere
    python examples/flux_generate.py --model-dir DIR --tp 2 --sp 2  # a local Flux pipeline directory

Nothing is downloaded. With --tiny the image is compared with diffusers' pipeline on one device.
Flux is guidance-distilled (no CFG batch): ``--cfg 2`` adds a negative prompt and
``true_cfg_scale`` so that there is one.
"""

from __future__ import annotations

import sys

from diffusion_generate import main

if __name__ == "__main__":
    cfg = any(a == "--cfg" and b != "1" for a, b in zip(sys.argv, sys.argv[1:]))
    extra = {"negative_prompt": "", "true_cfg_scale": 2.0} if cfg else {}
    raise SystemExit(main("flux", __doc__.splitlines()[0], extra))
