"""Attention sites of a fairseq encoder-decoder Transformer, and gates that always take effect.

fairseq's ``MultiheadAttention.forward`` has two code paths. When ``incremental_state`` is
None, ``static_kv`` is False and a few other conditions hold (encoder self-attention always;
decoder self-attention when scoring a whole target at once) it calls
``F.multi_head_attention_forward`` with ``out_proj.weight`` as a plain tensor, so
``out_proj`` never runs as a module and a forward pre-hook on it silently does nothing.
The other path calls ``self.out_proj(attn)`` and the hook works.

The fused path is skipped whenever ``skip_embed_dim_check`` is True: that is the flag fairseq
sets itself after pruning heads (``_set_skip_embed_dim_check``), and its only other effect is
to skip an assertion on the query's embedding size. :class:`FairseqHeadGates` sets it on exactly
the modules that have a gate set (``keep_fused``, the default): a module no mask of the batch
touches keeps fairseq's fused kernel, as the same model with weight surgery runs in fairseq
(whose results it then equals bit for bit), and a gated one takes the path its hook acts on.
With ``keep_fused=False`` every gated module is kept off the fused path for as long as the gates
are installed (masked or not: the plain reference, where a baseline and its ablations share
one arithmetic). :meth:`FairseqHeadGates.unfused` turns the fused path off everywhere for a
while (encoder reuse records per-head contexts, which only the unfused path computes), and
``remove()`` restores every module's own value.

Only calls without an incremental state take the fused path: in beam search that is the
encoder; decoder self-attention takes it in teacher-forced scoring, encoder-decoder attention never.

fairseq is time-first: the output projection's input is (time, batch, embed), so
``batch_dim=1``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import AttentionSite, HeadGates


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
    """Head gates for fairseq models that keep every gated module off the fused path.

    ``keep_fused`` (default): only modules with a gate set leave the fused path, and only while
    it is set. False: every module stays off it until ``remove()`` (the plain reference).
    """

    def __init__(self, sites: Sequence[AttentionSite], keep_fused: bool = True):
        super().__init__(sites)
        self.keep_fused = keep_fused
        self._saved_flags = [(s.module, s.module.skip_embed_dim_check) for s in self.sites]
        self._unfused = 0
        self._sync_paths()

    def _sync_paths(self) -> None:
        """Each module off the fused path iff it is gated now (or always, without ``keep_fused``)."""
        if not self._saved_flags:  # removed: the modules have their own values back
            return
        everywhere = self._unfused > 0 or not self.keep_fused
        for site, (module, stock) in zip(self.sites, self._saved_flags, strict=True):
            module.skip_embed_dim_check = stock or everywhere or site.key in self._gates

    # Every way of setting gates ends here, so no gate is ever set on a module on the fused path
    # (where its hook would silently not run).
    def clear(self) -> None:
        super().clear()
        self._sync_paths()

    def set_mask(self, masked, device=None) -> None:
        super().set_mask(masked, device)
        self._sync_paths()

    def set_masks_per_example(self, masks, rows_per_mask, device=None) -> None:
        super().set_masks_per_example(masks, rows_per_mask, device)
        self._sync_paths()

    def set_values(self, values) -> None:
        super().set_values(values)
        self._sync_paths()

    @contextmanager
    def ungated(self) -> Iterator[None]:
        """No gates and no fill inside, as :meth:`HeadGates.ungated`, with each module's path following: the base
        class empties and refills the gate table without :meth:`_sync_paths`, which would leave a module gated again
        after a donor pass (resample ablation) on the fused path, where its hook never runs."""
        try:
            with super().ungated():
                self._sync_paths()
                yield
        finally:
            self._sync_paths()

    @contextmanager
    def unfused(self) -> Iterator[None]:
        """Every gated module off the fused path inside (gates set or not), as it was after."""
        self._unfused += 1
        self._sync_paths()
        try:
            yield
        finally:
            self._unfused -= 1
            self._sync_paths()

    def remove(self) -> None:
        """Take the hooks off and give each module its fused path back."""
        super().remove()
        for module, flag in self._saved_flags:
            module.skip_embed_dim_check = flag
        self._saved_flags = []

    def restore_stock(self, site: AttentionSite, module: nn.Module) -> None:
        """Give ``module`` its fused path back wherever its shapes allow it (not once heads were removed)."""
        module.skip_embed_dim_check = module.num_heads * module.head_dim != module.out_proj.out_features


def gate_fairseq_model(model: nn.Module, keep_fused: bool = True) -> FairseqHeadGates:
    """Install gates on every attention module of a fairseq encoder-decoder model (see :class:`FairseqHeadGates`)."""
    return FairseqHeadGates(find_fairseq_sites(model), keep_fused)
