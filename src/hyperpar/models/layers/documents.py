"""Packed documents: where each document of a row starts, derived once per forward from the positions.

Convention (transformers' ``DataCollatorWithFlattening``): within a row, a position id equal to 0
after the first token starts a new document. 4-row (text, T, H, W) positions carry it in the text
row; 3-row (T, H, W) positions have no text row (vision tokens repeat T values) and mean one
document per row. An attention mask (1 = real token) adds a start at every change, so padding is
a span of its own whatever the positions say.

``Documents.from_positions`` returns None when every row is one document, so the kernels keep their
unpacked path (and speed) exactly; otherwise the descriptor says, per token, which document of its
row it belongs to and where that document starts. Everything is per token, never per head, so a
head-sharded (tensor-parallel) kernel reads the same descriptor as the full one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def text_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The (B, S) row that carries document starts, or None (3-row mRoPE positions carry none)."""
    if position_ids.dim() == 2:
        return position_ids
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:
        return position_ids[0]
    return None


def mtp_stream_rows(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, S − 1) bool: the multi-token-prediction stream rows that exist for some document alone. Row t
    reads token t's hidden state and token t + 1's embedding and predicts token t + 2; it is real
    when both tokens are real and token t + 1 does not start a document (packed rows, padding
    edges). None when nothing marks a start or padding (every row is real). No host sync: the
    objective masks MTP targets with it, the MTP module its router statistics."""
    keep = None
    pos = text_positions(position_ids) if position_ids is not None else None
    if pos is not None:
        keep = pos[:, 1:] != 0
    if attention_mask is not None:
        m = attention_mask.bool()
        both = m[:, 1:] & m[:, :-1]
        keep = both if keep is None else keep & both
    return keep


@dataclass(eq=False)
class Documents:
    """Document layout of a (B, S) batch with at least one row holding two or more documents.

    starts: (B, S) bool, True at the first token of each document (column 0 always).
    segment_ids: (B, S) int64, index of the token's document within its row (0, 1, …).
    offsets: (B, S) int64, index of the token within its document.
    cu_seqlens: (D + 1,) int32 document boundaries over the flattened B·S tokens (varlen kernels).
    lengths: the D document lengths in flattened order (host ints: per-document kernels and
    splits read them without a device sync).
    """

    starts: torch.Tensor
    segment_ids: torch.Tensor
    offsets: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: list[int]
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)

    @property
    def num_documents(self) -> int:
        return len(self.lengths)

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> Documents | None:
        """From a (B, S) bool start mask (column 0 is forced on); None if no row has a second document."""
        starts = starts.clone()
        starts[:, 0] = True
        B, S = starts.shape
        if not bool(starts[:, 1:].any()):  # the one host sync of the unpacked path
            return None
        segment_ids = starts.cumsum(1) - 1
        idx = torch.arange(S, device=starts.device).expand(B, S)
        begin = torch.where(starts, idx, torch.zeros_like(idx)).cummax(1).values
        flat_starts = starts.reshape(-1).nonzero().flatten()
        cu = torch.cat([flat_starts, flat_starts.new_tensor([B * S])]).to(torch.int32)
        lengths = cu.diff().tolist()
        return cls(starts, segment_ids, idx - begin, cu, lengths)

    @classmethod
    def from_positions(
        cls, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None
    ) -> Documents | None:
        """The layout that (B, S) / (3|4, B, S) positions encode, with every change of the optional
        (B, S) ``attention_mask`` (1 = real token) starting a span too, so padding anywhere in a
        row is a document of its own. None: one document per row."""
        starts = None
        pos = text_positions(position_ids) if position_ids is not None else None
        if pos is not None:
            starts = pos == 0
        if attention_mask is not None:
            m = attention_mask.bool()
            edges = torch.zeros_like(m)
            edges[:, 1:] = m[:, 1:] != m[:, :-1]
            starts = edges if starts is None else starts | edges
        return cls.from_starts(starts) if starts is not None else None

    def shifted_for_mtp(self) -> Documents | None:
        """The layout of the multi-token-prediction stream (S − 1 rows; row t reads token t's hidden
        state and token t + 1's embedding). A row whose two tokens lie in different documents is a
        document of its own, so every document's stream is the one it would have alone."""
        s = self.starts
        return Documents.from_starts(s[:, 1:] | s[:, :-1])

    # --- derived index sets, built once per descriptor and reused by every layer ---------------

    def conv_fixups(self, kernel_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a causal conv of ``kernel_size`` taps: the flattened tokens whose window crosses a
        document start inside the row (P,), the source token of each of their taps (P, K) (clamped
        to a valid index) and which taps stay inside the document (P, K) bool. Tap i reads token
        t − (K − 1 − i)."""
        key = ("conv", kernel_size)
        if key not in self._cache:
            K = kernel_size
            B, S = self.starts.shape
            hit = (self.segment_ids > 0) & (self.offsets < K - 1)
            tokens = hit.reshape(-1).nonzero().flatten()  # (P,)
            shift = torch.arange(K - 1, -1, -1, device=tokens.device)  # tap i reads t − shift[i]
            src = tokens.unsqueeze(1) - shift  # (P, K)
            valid = shift <= self.offsets.reshape(-1)[tokens].unsqueeze(1)
            self._cache[key] = (tokens, src.clamp_min(0), valid)
        return self._cache[key]

    def block_causal_mask(self) -> torch.Tensor:
        """(B, 1, S, S) bool, True where query i may attend key j: same document and j ≤ i."""
        if "mask" not in self._cache:
            seg = self.segment_ids
            S = seg.shape[1]
            causal = torch.ones(S, S, dtype=torch.bool, device=seg.device).tril()
            self._cache["mask"] = ((seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal).unsqueeze(1)
        return self._cache["mask"]
