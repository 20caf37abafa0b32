"""``data=megatron``: a Megatron ``.bin``/``.idx`` corpus or a weighted blend of them, sampled as megatron-core does.

``data.prefix`` names one corpus (``/data/wiki`` for ``/data/wiki.bin`` + ``.idx``); ``data.blend`` a
blend, as megatron's string ``"0.3 /data/a 0.7 /data/b"`` or a YAML list of ``{weight, prefix}``.
``data.split`` picks train / valid / test of megatron's ``--split`` string ``data.extra.split``
(e.g. ``"969,30,1"``; null: every sequence is train). The EOD id (needed by the reset/mask options)
is ``data.extra.eod_token_id`` or the eos of ``data.tokenizer``. The built indices are cached in
``data.cache_dir`` (default: beside the corpus, when writable). ``data.extra.blend_schedule`` orders
a blend's corpora: ``bounded`` (default: every corpus within one sample of its weight at every
step) or ``megatron`` (megatron-core's order, to reproduce a Megatron-LM run sample for sample).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hyperpar.data.megatron.blend import SCHEDULES, check_blend_prefixes, is_number
from hyperpar.data.megatron.source import MegatronSource
from hyperpar.data.registry import DataContext, register_dataset
from hyperpar.errors import DataError

log = logging.getLogger("hyperpar")

_SPLITS = ("train", "valid", "test")


def _expand(prefix: Any) -> str:
    from hyperpar.data.hf import resolve_path

    return str(resolve_path(str(prefix)))


def _blend(blend: Any) -> Any:
    """Resolve ``~`` / ``pkg://`` in every prefix of a blend, whatever its spelling."""
    check_blend_prefixes(blend)
    if isinstance(blend, str):
        words = blend.split()
        return " ".join(w if is_number(w) else _expand(w) for w in words)
    out = []
    for entry in blend:
        if isinstance(entry, Mapping):  # a dict, or an OmegaConf DictConfig from a YAML list
            entry = dict(entry)
            out.append({**entry, "prefix": _expand(entry["prefix"])} if "prefix" in entry else entry)
        else:
            out.append(entry if is_number(str(entry)) else _expand(entry))
    return out


@register_dataset("megatron", fields=("prefix", "blend", "split", "tokenizer", "cache_dir"),
                  extra=("split", "eod_token_id", "reset_position_ids", "reset_attention_mask", "eod_mask_loss", "blend_schedule"))
def build_megatron(options: dict, ctx: DataContext) -> Any:
    extra = dict(options.get("extra") or {})
    prefix, blend = options.get("prefix"), options.get("blend")
    if (prefix is None) == (blend is None or blend == [] or blend == ""):
        raise DataError("data=megatron needs exactly one of data.prefix or data.blend",
                        hint="data.prefix=/data/corpus (for corpus.bin/.idx) or data.blend='0.3 /data/a 0.7 /data/b'")
    split = options.get("split") or "train"
    if split not in _SPLITS:
        raise DataError(f"data.split={split!r} is not one of {', '.join(_SPLITS)} for megatron data",
                        hint="megatron's --split ratios go in data.extra.split, e.g. '969,30,1'")
    eod = extra.get("eod_token_id")
    if eod is None and options.get("tokenizer"):
        from hyperpar.data.hf import load_tokenizer

        eod = load_tokenizer(options["tokenizer"]).eos_token_id
    flags = {k: bool(extra.get(k, False)) for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")}
    if eod is None and any(flags.values()):
        on = ", ".join(k for k, v in flags.items() if v)
        raise DataError(f"{on} needs the EOD token id", hint="set data.extra.eod_token_id or data.tokenizer")
    schedule = extra.get("blend_schedule") or "bounded"
    if schedule not in SCHEDULES:
        raise DataError(f"data.extra.blend_schedule={schedule!r} is not one of {', '.join(SCHEDULES)}",
                        hint="bounded: every corpus within one sample of its weight; megatron: Megatron-LM's order")
    cache_dir = options.get("cache_dir")
    source = MegatronSource(
        prefix=_expand(prefix) if prefix is not None else None,
        blend=_blend(blend) if prefix is None else None,
        seq_len=ctx.seq_len, num_samples=ctx.num_samples, seed=ctx.seed, eod_token_id=eod,
        cache_dir=os.path.expanduser(str(cache_dir)) if cache_dir else None,
        split=str(extra["split"]) if extra.get("split") is not None else None, index_split=split,
        blend_schedule=schedule, vocab_size=ctx.vocab_size, **flags)
    if len(source) < ctx.num_samples:
        raise DataError(f"the Megatron data gives {len(source)} samples but the run needs {ctx.num_samples}",
                        hint="more data, fewer train.steps or a smaller global batch")
    log.info("data: megatron %s%s, %d samples of %d tokens", prefix or blend,
             "" if prefix is not None else f" ({schedule} schedule)", len(source), ctx.seq_len)
    return source
