"""One rank's share of a full batch, as its data iterator loaded it (``Sample``), and the
formats ``as_samples`` accepts (lists of samples, dicts, tuples, Megatron batch dicts with or
without ``cu_seqlens``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

MASK_DTYPE = torch.float32


@dataclass(frozen=True)
class Sample:
    """One sequence as its rank loaded it: ``tokens``, ``labels`` (next tokens) and
    ``loss_mask`` (per-token loss weights, usually 0/1), all 1-D of the sequence's length."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor

    def __post_init__(self):
        shapes = {tuple(t.shape) for t in (self.tokens, self.labels, self.loss_mask)}
        if len(shapes) != 1 or self.tokens.dim() != 1:
            raise ValueError(f"a sample's tokens, labels and loss_mask must be 1-D of one length, got shapes "
                             f"{[tuple(t.shape) for t in (self.tokens, self.labels, self.loss_mask)]}")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self) -> torch.Tensor:
        """``[L, 3]`` int64: token, label, loss-mask bits (fp32 bit pattern, exact)."""
        bits = self.loss_mask.to(MASK_DTYPE).contiguous().view(torch.int32).long()
        return torch.stack((self.tokens.long(), self.labels.long(), bits), dim=1)


def _sample(tokens, labels, loss_mask=None) -> Sample:
    tokens, labels = torch.as_tensor(tokens).reshape(-1), torch.as_tensor(labels).reshape(-1)
    mask = torch.ones(tokens.shape, dtype=MASK_DTYPE) if loss_mask is None else torch.as_tensor(loss_mask).reshape(-1)
    return Sample(tokens.cpu(), labels.cpu(), mask.to(MASK_DTYPE).cpu())


def as_samples(item) -> List[Sample]:
    """This rank's share of the full batch as ``Sample`` s. Accepted: a list of ``Sample``, of
    dicts (``tokens``, ``labels``, optional ``loss_mask``, 1-D) or of (tokens, labels[, mask])
    tuples; or a Megatron batch dict: ``tokens``/``labels``/``loss_mask`` ``[b, s]`` with each row
    one sample, or ``[1, T]`` / ``[T]`` packed documents with ``cu_seqlens`` (entries < 0, the
    padding of Megatron's fixed-size ``cu_seqlens``, are dropped)."""
    if isinstance(item, dict):
        tokens, labels, mask = item["tokens"], item["labels"], item.get("loss_mask")
        cu = item.get("cu_seqlens")
        if cu is not None:
            cu = torch.as_tensor(cu).reshape(-1).long().cpu()
            cu = cu[cu >= 0]
            flat = [t.reshape(-1) if t is not None else None for t in (tokens, labels, mask)]
            bounds = cu.tolist()
            if bounds[0] != 0 or bounds[-1] != flat[0].numel() or any(b <= a for a, b in zip(bounds, bounds[1:])):
                raise ValueError(f"cu_seqlens {bounds} do not cut the {flat[0].numel()} packed tokens into non-empty "
                                 f"documents")
            return [_sample(flat[0][a:b], flat[1][a:b], None if flat[2] is None else flat[2][a:b])
                    for a, b in zip(bounds, bounds[1:])]
        tokens = torch.as_tensor(tokens)
        if tokens.dim() == 1:
            return [_sample(tokens, labels, mask)]
        return [_sample(tokens[i], labels[i], None if mask is None else mask[i]) for i in range(tokens.shape[0])]
    out = []
    for s in item:
        if isinstance(s, Sample):
            out.append(s)
        elif isinstance(s, dict):
            out.append(_sample(s["tokens"], s["labels"], s.get("loss_mask")))
        else:
            out.append(_sample(*s))
    return out


def split_documents(batch: dict) -> List[Sample]:
    """The documents of a Megatron GPT batch (``tokens``/``labels``/``loss_mask``/``position_ids``
    ``[b, s]``, rows of packed documents, as Megatron's ``GPTDataset`` builds them with
    ``reset_position_ids``): a document starts where a row starts or where its position does not
    follow the previous one (the reset after each end-of-document token). A batch with
    ``cu_seqlens`` (packed THD) is cut by those instead (``as_samples``)."""
    if batch.get("cu_seqlens") is not None:
        return as_samples(batch)
    missing = [k for k in ("tokens", "labels", "position_ids") if batch.get(k) is None]
    if missing:
        raise ValueError(f"a batch without {missing} cannot be cut into documents (keys: {sorted(batch)})")
    tokens = torch.as_tensor(batch["tokens"]).cpu()
    labels = torch.as_tensor(batch["labels"]).cpu()
    pos = torch.as_tensor(batch["position_ids"]).cpu()
    mask = batch.get("loss_mask")
    mask = torch.ones(tokens.shape, dtype=MASK_DTYPE) if mask is None else torch.as_tensor(mask).cpu()
    if tokens.dim() == 1:
        tokens, labels, pos, mask = tokens[None], labels[None], pos[None], mask[None]
    if pos.shape != tokens.shape:
        raise ValueError(f"position_ids {tuple(pos.shape)} do not match tokens {tuple(tokens.shape)}")
    out = []
    for row in range(tokens.shape[0]):
        p = pos[row]
        starts = torch.ones_like(p, dtype=torch.bool)
        starts[1:] = p[1:] != p[:-1] + 1
        bounds = starts.nonzero().squeeze(1).tolist() + [p.numel()]
        out.extend(_sample(tokens[row, a:b], labels[row, a:b], mask[row, a:b]) for a, b in zip(bounds, bounds[1:]))
    return out
