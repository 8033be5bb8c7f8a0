"""Find the attention modules of a transformers model and their output projections.

The layouts recognised (BERT family, DistilBERT, Llama-style decoders, GPT-2 and GPTBigCode) are
described once, in :mod:`headsweep.workers.families.hf_shared.layout`.
"""

from __future__ import annotations

from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.families.hf_shared.layout import attention_layout, projection_inputs


class TransformersSite(AttentionSite):
    """An attention site whose output projection may be transformers' ``Conv1D`` (GPT-2) as well as
    ``nn.Linear``: the gate acts on the projection's input either way, only the width is read otherwise."""

    def check_projection(self) -> None:
        width = projection_inputs(self.out_proj)
        if width != self.num_heads * self.head_dim:
            raise HeadsweepError(
                f"{self.module_name}: output projection takes {width} features, "
                f"not num_heads x head_dim = {self.num_heads} x {self.head_dim}"
            )


def find_sites(model: nn.Module) -> list[AttentionSite]:
    """Every self-attention module of an encoder-only or decoder-only transformers model.

    Layers are numbered in module order, which is the order of the layer stack.
    """
    sites: list[AttentionSite] = []
    layer = 0
    for name, module in model.named_modules():
        found = attention_layout(module)
        if found is None:
            continue
        layer += 1
        if found.num_heads == 0:  # every head of this layer was physically removed: nothing to gate
            continue
        site_class = AttentionSite if isinstance(found.out_proj, nn.Linear) else TransformersSite
        sites.append(
            site_class(
                attention="self",
                layer=layer - 1,
                num_heads=found.num_heads,
                head_dim=found.head_dim,
                out_proj=found.out_proj,
                module=module,
                module_name=name,
                batch_dim=0,
            )
        )
    return sites
