"""Find the attention modules of a transformers model and their output projections.

Head counts and sizes are read from the modules themselves, never from user input. Each
recogniser below names the architecture family whose layout it matches.
"""

from __future__ import annotations

from torch import nn

from headsweep.workers.gates import AttentionSite


def _bert_family(module: nn.Module) -> tuple[int, int, nn.Linear] | None:
    # BertAttention / RobertaAttention / ElectraAttention ...: .self holds the heads,
    # .output.dense is W_O.
    inner = getattr(module, "self", None)
    output = getattr(module, "output", None)
    if inner is None or output is None or not isinstance(getattr(output, "dense", None), nn.Linear):
        return None
    if not hasattr(inner, "num_attention_heads") or not hasattr(inner, "attention_head_size"):
        return None
    if getattr(module, "is_cross_attention", False):
        return None
    return inner.num_attention_heads, inner.attention_head_size, output.dense


def _distilbert_family(module: nn.Module) -> tuple[int, int, nn.Linear] | None:
    out = getattr(module, "out_lin", None)
    if not isinstance(out, nn.Linear) or not hasattr(module, "n_heads"):
        return None
    # After physical pruning `dim` is still the model width, but out_lin takes only the kept heads.
    return module.n_heads, (out.in_features // module.n_heads if module.n_heads else 0), out


def _llama_family(module: nn.Module) -> tuple[int, int, nn.Linear] | None:
    # Decoder-only models (Llama, Mistral, Qwen, ...): o_proj takes num_heads * head_dim.
    out = getattr(module, "o_proj", None)
    config = getattr(module, "config", None)
    if not isinstance(out, nn.Linear) or config is None or not hasattr(module, "head_dim"):
        return None
    return config.num_attention_heads, module.head_dim, out


RECOGNISERS = (_bert_family, _distilbert_family, _llama_family)


def find_sites(model: nn.Module) -> list[AttentionSite]:
    """Every self-attention module of an encoder-only or decoder-only transformers model.

    Layers are numbered in module order, which is the order of the layer stack.
    """
    sites: list[AttentionSite] = []
    layer = 0
    for name, module in model.named_modules():
        for recognise in RECOGNISERS:
            found = recognise(module)
            if found is not None:
                num_heads, head_dim, out_proj = found
                layer += 1
                if num_heads == 0:  # every head of this layer was physically removed: nothing to gate
                    break
                sites.append(
                    AttentionSite(
                        attention="self",
                        layer=layer - 1,
                        num_heads=int(num_heads),
                        head_dim=int(head_dim),
                        out_proj=out_proj,
                        module=module,
                        module_name=name,
                        batch_dim=0,
                    )
                )
                break
    return sites
