"""Find the attention modules of a transformers model and their output projections.

The layouts recognised (BERT family, DistilBERT, Llama-style decoders) are described once, in
:mod:`headsweep.workers.families.hf_classifier.layout`.
"""

from __future__ import annotations

from torch import nn

from headsweep.workers.families.hf_classifier.layout import attention_layout
from headsweep.workers.gates import AttentionSite


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
        sites.append(
            AttentionSite(
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
