"""Which checkpoint key each of a model's tensors is read from: the checkpoint's keys renamed as
the model's library renames them when it loads them itself.

- diffusers: the attention blocks built with ``_from_deprecated_attn_block`` (the VAE's and the
  UNets' mid-block attention) were saved by old diffusers as ``query``/``key``/``value``/
  ``proj_attn``; diffusers reads them as ``to_q``/``to_k``/``to_v``/``to_out.0``
  (``ModelMixin._fix_state_dict_keys_on_load``), for a checkpoint of one file only, and a legacy
  key there wins over a new one. The same rule here.
- transformers: the renamings ``from_pretrained`` applies (``get_model_conversion_mapping``:
  the user's ``key_mapping`` regexes, then the model's own and the legacy ones such as
  ``gamma`` -> ``weight``), and the base-model prefix added or stripped, by transformers' own
  ``rename_source_key``. A conversion that merges or splits tensors (a ``WeightConverter``) is
  not done here: it raises, naming the keys.
"""

from __future__ import annotations

from .weight_files import NotAPretrainedModelError

# diffusers' legacy attention names -> the current ones
LEGACY_ATTENTION = (("query", "to_q"), ("key", "to_k"), ("value", "to_v"), ("proj_attn", "to_out.0"))


def checkpoint_keys(model, files: dict, library: str, *, sharded: bool, key_mapping: dict | None = None) -> dict:
    """``{model tensor name: checkpoint key}`` for every key of ``files`` (``{checkpoint key:
    file}``) the model may read, named as ``library`` would name it."""
    if library == "diffusers":
        if key_mapping:
            raise NotAPretrainedModelError("key_mapping renames the keys of a transformers checkpoint; "
                                           f"{type(model).__name__} is a diffusers model")
        keys = {k: k for k in files}
        if not sharded:
            keys.update(legacy_attention_keys(model, files))
        return keys
    return _transformers_keys(model, files, key_mapping)


def legacy_attention_keys(model, files) -> dict:
    """``{current name: legacy checkpoint key}`` of the deprecated attention blocks' tensors
    that ``files`` holds under their old names."""
    keys = {}
    for path, module in model.named_modules():
        if not getattr(module, "_from_deprecated_attn_block", False):
            continue
        for old, new in LEGACY_ATTENTION:
            for what in ("weight", "bias"):
                legacy = f"{path}.{old}.{what}" if path else f"{old}.{what}"
                if legacy in files:
                    keys[f"{path}.{new}.{what}" if path else f"{new}.{what}"] = legacy
    return keys


def _transformers_keys(model, files: dict, key_mapping: dict | None) -> dict:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model, key_mapping)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    names = dict.fromkeys(model.state_dict(keep_vars=True))       # meta tensors: names only
    prefix = getattr(model, "base_model_prefix", None)
    keys, converted = {}, []
    for key in sorted(files):
        name, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if name not in names and key in names:        # as transformers: not renamed after all, maybe prefixed
            name, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=names)
        if pattern is not None and name in names:
            converted.append(key)
            continue
        if name in keys and keys[name] != key:
            raise NotAPretrainedModelError(f"checkpoint keys {keys[name]!r} and {key!r} are both renamed to {name!r}"
                                           + (f" (key_mapping {key_mapping})" if key_mapping else ""))
        keys[name] = key
    if converted:
        raise NotAPretrainedModelError(
            f"{type(model).__name__}'s checkpoint keys {converted[:10]} need transformers' weight conversions "
            "(tensors merged or split on load), which dtorch_hf.from_pretrained does not do; load the model with "
            "transformers and lay it out with dtorch_hf.parallelize")
    return keys
