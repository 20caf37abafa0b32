"""MegatronSource: a Megatron corpus or blend as a hyperpar sample source.

Sample ``i`` is sample ``i`` of the dataset megatron-core would build for the same corpus, blend,
sequence length, seed and sample count, turned into the trainer's shapes: ``input_ids``,
``labels`` (already shifted, -100 where megatron's loss mask is 0) and ``position_ids``. Blends
default to the bounded schedule (every corpus within one sample of its weight at every step);
``blend_schedule="megatron"`` gives megatron-core's blend order too, sample for sample.
"""

from __future__ import annotations


import numpy as np
import torch

from hyperpar.data.megatron.blend import BlendSpec, build_gpt_dataset, check_schedule, parse_blend
from hyperpar.data.megatron.gpt import GPTDatasetConfig, ltor_masks_and_position_ids
from hyperpar.errors import DataError

IGNORE_INDEX = -100


class MegatronSource:
    """Either ``prefix`` (one corpus) or ``blend`` (``"0.3 /a 0.7 /b"`` or ``[{weight, prefix}]``).

    ``split`` is megatron's ``--split`` string (e.g. ``"969, 30, 1"``) when the run being matched
    used one; None takes every sequence. ``reset_position_ids`` or ``reset_attention_mask`` make the
    positions restart at 0 after every EOD, which is how the models see a document start
    (attention, GatedDeltaNet state and conv then stay inside each document; the two flags mean
    the same here, as a restart is the boundary). ``blend_schedule``
    orders a blend's corpora: ``"bounded"`` (default) or ``"megatron"`` (upstream's order, to
    reproduce a Megatron-LM run); see ``hyperpar.data.megatron.blend``.
    """

    def __init__(self, prefix: str | None = None, blend: BlendSpec | None = None, *, seq_len: int,
                 num_samples: int | None, seed: int = 1234, eod_token_id: int | None = None,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False,
                 eod_mask_loss: bool = False, cache_dir: str | None = None, split: str | None = None,
                 index_split: str = "train", blend_schedule: str = "bounded", vocab_size: int | None = None) -> None:
        if (prefix is None) == (blend is None):
            raise DataError("give exactly one of data prefix or blend")
        self.vocab_size = vocab_size  # ids at or above it would index past the embedding (checked per sample)
        self._name = prefix if prefix is not None else blend
        self.blend_schedule = check_schedule(blend_schedule)
        self.config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_len, split=split, path_to_cache=cache_dir,
            reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
            eod_mask_loss=eod_mask_loss, eod_token_id=eod_token_id)
        spec = ([str(prefix)], None) if prefix is not None else parse_blend(blend)  # type: ignore[arg-type]
        self.dataset = build_gpt_dataset(spec, num_samples, self.config, index_split, blend_schedule)
        total = len(self.dataset)
        self._len = total if num_samples is None else min(num_samples, total)
        if self._len == 0:
            raise DataError(f"the Megatron data {prefix or blend} yields no sample of "
                            f"{seq_len + 1} tokens", hint="use a shorter seq_len or more data")

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        i = int(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"sample {index} out of range for {self._len} samples")
        s = self.dataset.sample(i)
        if self.vocab_size is not None:
            self._check_ids(i, s["tokens"], s["labels"][s["loss_mask"] > 0])
        labels = np.where(s["loss_mask"] > 0, s["labels"], IGNORE_INDEX)
        positions = s["position_ids"]
        if self.config.reset_attention_mask and not self.config.reset_position_ids:
            positions = document_positions(s["tokens"], self.config.eod_token_id)
        return {
            "input_ids": torch.from_numpy(s["tokens"]),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions),
        }

    def _check_ids(self, index: int, *arrays: np.ndarray) -> None:
        """A token id the model has no row for (a corpus tokenized with a larger vocabulary, or a damaged
        .bin) is a data error naming the corpus and sample, not an IndexError (or a device assert) in the
        embedding at whichever step first reads it. One max/min over seq_len ids per sample."""
        for ids in arrays:
            if ids.size and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
                bad = int(ids.max()) if int(ids.max()) >= self.vocab_size else int(ids.min())
                raise DataError(f"the Megatron data {self._name}: sample {index} holds token id {bad}, outside the "
                                f"model's vocabulary of {self.vocab_size} ids",
                                hint="tokenize the corpus with the model's tokenizer (python -m "
                                     "hyperpar.data.megatron.convert --tokenizer ...), or check the .bin for damage")


def document_positions(tokens: np.ndarray, eod: int | None) -> np.ndarray:
    """Positions restarting at 0 on the token after each EOD (megatron's ``reset_position_ids``)."""
    _, _, positions = ltor_masks_and_position_ids(tokens, eod, True, False, False, False)
    return positions
