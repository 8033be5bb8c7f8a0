"""FLOPs counted from a transformers config (:class:`Arch`, the formulas of ``bench/real_size.py``'s docstring), and
the float32 matrix-product rate of this CPU they are set against (real_size, lm_grid)."""

from __future__ import annotations

from dataclasses import dataclass

from bench.gpu_check import matmul_rate


@dataclass(frozen=True)
class Arch:
    """What the FLOP count reads from a transformers config."""

    causal: bool
    layers: int
    hidden: int
    inner: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    ffn_mats: int
    labels: int

    @classmethod
    def of(cls, config) -> Arch:
        """The shape of a transformers ``config`` (Llama, Qwen2, GPT-2 or BERT)."""
        h, heads = config.hidden_size, config.num_attention_heads
        inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
        return cls(causal=config.model_type != "bert", layers=config.num_hidden_layers, hidden=h, inner=inner,
                   heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or h // heads, vocab=config.vocab_size,
                   ffn_mats=3 if config.model_type in ("llama", "qwen2") else 2,
                   labels=getattr(config, "num_labels", 2))

    def layer(self, rows: int, length: int) -> tuple[float, float, float]:
        """(projections, feed-forward, attention) FLOPs of one layer over ``rows`` sequences of ``length``."""
        q, kv, h, tokens = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, rows * length
        proj = 2 * tokens * (h * (q + 2 * kv) + q * h)
        ffn = 2 * tokens * self.ffn_mats * h * self.inner
        pairs = length * (length + 1) / 2 if self.causal else length * length
        attn = 4 * rows * self.heads * self.head_dim * pairs
        return proj, ffn, attn

    def head(self, rows: int, logits: int) -> float:
        """The LM head over ``logits`` positions per row, or a classifier's pooler and classification layer."""
        if self.causal:
            return 2 * rows * logits * self.hidden * self.vocab
        return 2 * rows * (self.hidden * self.hidden + self.hidden * self.labels)

    def mask(self, batches: list[tuple[int, int, int]], first: int | None) -> float:
        """FLOPs of one mask over ``batches`` (rows, length, logits per row): the whole model (``first`` None:
        the plain path) or from layer ``first`` on, as reuse runs it."""
        total = 0.0
        for rows, length, logits in batches:
            proj, ffn, attn = self.layer(rows, length)
            if first is None:
                total += self.layers * (proj + ffn + attn)
            else:
                out_proj = 2 * rows * length * self.heads * self.head_dim * self.hidden
                total += out_proj + ffn + (self.layers - 1 - first) * (proj + ffn + attn)
            total += self.head(rows, logits)
        return total


def first_layer(mask: list[str]) -> int:
    """The first layer a mask of head names (``attention:layer:head``) gates."""
    return min(int(name.split(":")[1]) for name in mask)


def cpu_matmul_rate(threads: int = 1, n: int = 2048, seconds: float = 2.0) -> float:
    """FLOP/s of ``torch.mm`` of two ``n`` x ``n`` float32 matrices on ``threads`` threads: the fastest single product
    of those run in ``seconds`` (on a shared machine other processes only ever slow a product down, so the fastest is
    the closest to what the cores can do)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return matmul_rate("cpu", torch.float32, n=n, seconds=seconds, fastest=True)[1]
    finally:
        torch.set_num_threads(before)
