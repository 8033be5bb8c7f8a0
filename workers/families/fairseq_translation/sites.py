"""Attention sites of a fairseq encoder-decoder Transformer, and gates that always take effect.

fairseq's ``MultiheadAttention.forward`` has two code paths. When ``incremental_state`` is
None, ``static_kv`` is False and a few other conditions hold (encoder self-attention always;
decoder self-attention when scoring a whole target at once) it calls
``F.multi_head_attention_forward`` with ``out_proj.weight`` as a plain tensor, so
``out_proj`` never runs as a module and a forward pre-hook on it silently does nothing.
The other path calls ``self.out_proj(attn)`` and the hook works.

The fused path is skipped whenever ``skip_embed_dim_check`` is True: that is the flag fairseq
sets itself after pruning heads (``_set_skip_embed_dim_check``), and its only other effect is
to skip an assertion on the query's embedding size. :class:`FairseqHeadGates` sets it on every
gated module for as long as the gates are installed (masked or not, so a baseline and its
ablations are computed by the same arithmetic) and restores the old value on ``remove()``.

fairseq is time-first: the output projection's input is (time, batch, embed), so
``batch_dim=1``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.gates import AttentionSite, HeadGates


def _site(attention: str, layer: int, module: nn.Module, name: str) -> AttentionSite:
    return AttentionSite(
        attention=attention,
        layer=layer,
        num_heads=int(module.num_heads),
        head_dim=int(module.head_dim),
        out_proj=module.out_proj,
        module=module,
        module_name=name,
        batch_dim=1,
    )


def has_layer_stacks(model: nn.Module) -> bool:
    """Whether ``model`` has fairseq's ``encoder.layers`` and ``decoder.layers``."""
    encoder = getattr(model, "encoder", None)
    decoder = getattr(model, "decoder", None)
    return encoder is not None and decoder is not None and hasattr(encoder, "layers") and hasattr(decoder, "layers")


def find_fairseq_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module of a fairseq encoder-decoder model (``TransformerModel`` and
    relatives): ``enc_self`` for encoder layers, ``enc_dec`` and ``dec_self`` for decoder layers,
    layers counted from 0 in stack order."""
    if not has_layer_stacks(model):
        raise HeadsweepError(
            f"{type(model).__name__} is not a fairseq encoder-decoder Transformer (no encoder.layers / decoder.layers)"
        )
    encoder, decoder = model.encoder, model.decoder
    sites: list[AttentionSite] = []
    for i, layer in enumerate(encoder.layers):
        sites.append(_site("enc_self", i, layer.self_attn, f"encoder.layers.{i}.self_attn"))
    for i, layer in enumerate(decoder.layers):
        sites.append(_site("dec_self", i, layer.self_attn, f"decoder.layers.{i}.self_attn"))
        if getattr(layer, "encoder_attn", None) is not None:
            sites.append(_site("enc_dec", i, layer.encoder_attn, f"decoder.layers.{i}.encoder_attn"))
    for site in sites:
        if not hasattr(site.module, "skip_embed_dim_check"):
            raise HeadsweepError(
                f"{site.module_name}: this fairseq version's MultiheadAttention has no skip_embed_dim_check, "
                "so its fused attention path cannot be turned off and head gates would be ignored"
            )
    return sites


class FairseqHeadGates(HeadGates):
    """Head gates for fairseq models that also keep every gated module off the fused path."""

    def __init__(self, sites: Sequence[AttentionSite]):
        super().__init__(sites)
        self._saved_flags = [(s.module, s.module.skip_embed_dim_check) for s in self.sites]
        for site in self.sites:
            site.module.skip_embed_dim_check = True

    def remove(self) -> None:
        """Take the hooks off and give each module its fused path back."""
        super().remove()
        for module, flag in self._saved_flags:
            module.skip_embed_dim_check = flag
        self._saved_flags = []

    def restore_stock(self, site: AttentionSite, module: nn.Module) -> None:
        """Give ``module`` its fused path back wherever its shapes allow it (not once heads were removed)."""
        module.skip_embed_dim_check = module.num_heads * module.head_dim != module.out_proj.out_features


def gate_fairseq_model(model: nn.Module) -> FairseqHeadGates:
    """Install gates on every attention module of a fairseq encoder-decoder model."""
    return FairseqHeadGates(find_fairseq_sites(model))
