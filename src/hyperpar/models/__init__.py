"""Model families and Hugging Face checkpoint I/O.

``from_hf(path)`` builds and loads a model from a Hugging Face directory, ``to_hf(model, path)``
writes one that transformers loads, ``HFCheckpoint(path)`` reads single tensors for a sharded load.
"""

from hyperpar.models.hf_io import HFCheckpoint, from_hf, to_hf

__all__ = ["HFCheckpoint", "from_hf", "to_hf"]
