"""A pruned transformers model as its stock architecture: the config states the pruned sizes, nothing else.

Which masks have a stock config is the family's (``hf_causal_lm.model.stock``: Llama-style decoders); what a config
cannot state is refused with the reason (:data:`TIED_HEAD_SIZE`: GPT-2 and BERT-family configs derive the head size
from the hidden size).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from headsweep.errors import HeadsweepError

#: The config keys a stock export sets (``hidden_size`` stays; ``num_heads``: T5-style encoder-decoders).
STOCK_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "num_heads")
TIED_HEAD_SIZE = ("{name}'s config derives the head size from the hidden size ({how}), so fewer heads would mean "
                  "smaller heads: no stock config states a pruned {name}; export without --stock "
                  "(headsweep.load_pruned loads the folder)")


def check_stock_config(model: nn.Module, sizes: dict[str, int]) -> None:
    """Refuse ``sizes`` that the model's config class itself rejects when ``from_pretrained`` reads them back
    (transformers 5's ``LlamaConfig`` and ``Gemma2Config`` require ``hidden_size`` to be a multiple of
    ``num_attention_heads`` even where ``head_dim`` is set), naming the head counts that would pass."""
    import copy

    config: Any = copy.deepcopy(model.config)
    for key, value in sizes.items():
        setattr(config, key, value)
    if hasattr(config, "pruned_heads"):
        delattr(config, "pruned_heads")
    try:
        config.validate()
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's strict dataclasses raise their own error types
        reason = str(exc.__cause__ or exc).strip().splitlines()[-1].strip()
        hidden, heads = getattr(config, "hidden_size", 0), getattr(model.config, "num_attention_heads", 0)
        fits = [n for n in range(1, heads) if hidden and hidden % n == 0]
        hint = (f"; it takes query head counts that divide hidden_size {hidden} ({', '.join(map(str, fits[-4:]))}, "
                "...): choose a level that keeps one of them") if fits else ""
        raise HeadsweepError(f"{type(config).__name__} refuses the pruned sizes {sizes} ({reason}), so stock "
                             f"from_pretrained could not load the folder{hint}, or export without --stock "
                             "(headsweep.load_pruned loads it)") from None


def stock_config(model: nn.Module, sizes: dict[str, int]) -> None:
    """Set ``sizes`` in the config of ``model`` (pruned by a mask the family's ``stock_sizes`` accepted) and drop
    ``pruned_heads``; refuses, leaving the config as it was, when the architecture built from that config does
    not have the pruned weights' shapes (a config class that ignores ``head_dim``)."""
    import torch

    config: Any = model.config
    before = {k: getattr(config, k, None) for k in (*STOCK_KEYS, "pruned_heads")}
    for key, value in sizes.items():
        setattr(config, key, value)
    if hasattr(config, "pruned_heads"):
        delattr(config, "pruned_heads")
    with torch.device("meta"):
        stock = type(model)(config)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in stock.state_dict().items()}
    wrong = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    if wrong:
        for key, value in before.items():
            if value is not None:
                setattr(config, key, value)
        raise HeadsweepError(f"{type(model).__name__} built from a config with {sizes} does not have the pruned "
                             f"weights' shapes ({wrong[0]}: {got.get(wrong[0])} vs {want.get(wrong[0])}): its "
                             "config cannot state the pruned model; export without --stock")
