"""Greedy generation with a T5 model tensor-parallel on a dtorch mesh (loaded by
``dtorch_hf.from_pretrained``: the weights read straight into shards), checked against the same
model on one device.

    python examples/t5_generate.py --tiny                   # a tiny random T5, runs anywhere
    python examples/t5_generate.py --model-dir DIR          # a local T5 checkpoint (+ tokenizer)

Nothing is downloaded: --tiny builds and saves a random model in a temporary directory.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings

import torch
from transformers import T5Config, T5ForConditionalGeneration

import dtorch_core as dt
import dtorch_hf


def tiny_model_dir(path: str) -> str:
    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, dropout_rate=0.0, initializer_factor=10.0,
                      feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    T5ForConditionalGeneration(config).save_pretrained(path)
    return path


def inputs(model_dir: str, prompt: str, tiny: bool):
    if tiny:
        ids = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(1))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return dict(tokenizer([prompt], return_tensors="pt")), tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tiny", action="store_true", help="a tiny random T5 (no weights needed)")
    source.add_argument("--model-dir", help="a local directory saved with save_pretrained")
    parser.add_argument("--prompt", default="translate English to German: The house is wonderful.")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (batch split)")
    parser.add_argument("--runner", default="thread", help="thread, process or inline")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()

    dt.init(world_size=args.tp * args.dp, runner=args.runner)
    dims = [(n, name) for n, name in ((args.tp, "tp"), (args.dp, "dp")) if n > 1] or [(1, "tp")]
    shape, names = tuple(n for n, _ in dims), tuple(name for _, name in dims)
    mesh = dt.init_device_mesh("cpu", shape, mesh_dim_names=names)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model_dir(tmp) if args.tiny else args.model_dir
        batch, tokenizer = inputs(model_dir, args.prompt, args.tiny)
        ref = T5ForConditionalGeneration.from_pretrained(model_dir).eval()
        # built on the meta device; each worker reads its own shards of the weights
        model = dtorch_hf.from_pretrained(model_dir, mesh=mesh)

    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # dtorch's one-time "no sharding rule" notes
        tokens = model.generate(**batch, **gen)
    tokens = tokens.full_tensor() if isinstance(tokens, dt.DTensor) else tokens
    seconds = time.perf_counter() - start
    want = ref.generate(**batch, **gen)
    print(f"mesh {dict(zip(names, shape))}: generated {tuple(tokens.shape)} in {seconds:.2f} s")
    print("tokens:", tokens.tolist())
    if tokenizer is not None:
        print("text:", tokenizer.batch_decode(tokens, skip_special_tokens=True))
    print("equal to one device:", torch.equal(tokens, want))
    print("replicated fallbacks:", dt.fallback_counts())
    dt.shutdown()
    return 0 if torch.equal(tokens, want) else 1


if __name__ == "__main__":
    raise SystemExit(main())
