"""Whether a transformers folder's ``config.json`` describes the weights beside it.

transformers builds the model that ``config.json`` describes and fits the saved tensors into it. What does not
fit goes to a "LOAD REPORT" in the worker's log, not to the console: tensors the model has no place for are
dropped (a config that says 2 layers beside weights of 3 evaluates the model without its third layer), tensors the
weights lack start from random numbers, and a tensor of another shape stops the load with a pointer to that report.
:func:`check_weights_fit` reads the report ``from_pretrained(..., output_loading_info=True,
ignore_mismatched_sizes=True)`` returns and refuses any of the three in one line.

The rule: every tensor of the weights is used and every tensor the model needs is loaded, except where transformers
itself knows better and leaves a key out of its report: a tied weight (``lm_head.weight`` with
``tie_word_embeddings``) is the tensor it is tied to, and buffers it computes instead of loading (``position_ids``,
rotary ``inv_freq``, GPT-2's causal ``attn.bias`` mask) are not weights. Two more are left out here, as they
cannot change what the model computes: ``attn.masked_bias``, a constant (-1e4) GPT-2 folders saved by transformers
2 to 4 hold, and a pooler beside a model that has none (RoBERTa's, ELECTRA's classifiers pool with their own head;
their checkpoints converted or fine-tuned from a pretrained model often keep its pooler). A classification or
language-model head the weights lack is refused before this, as the wrong kind of folder
(:func:`.architecture.check_loaded_weights`): a head of random numbers is nothing to sweep.

Head counts: Llama-style configs give the head size (``head_dim``) apart from the width, so
``num_attention_heads`` and ``num_key_value_heads`` set the projections' shapes and a wrong count is a wrong
shape, named here with the config's counts and the heads the weights hold. Where the head size is ``hidden_size /
num_attention_heads`` (BERT, RoBERTa, DistilBERT, GPT-2, and Llama-style configs without ``head_dim``), every count
that divides the width gives the same query/key/value/output shapes: the weights cannot tell such a count wrong.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError

SHOWN_KEYS = 3  # tensors named in the error line (the count is complete)
FIX = "correct config.json, or use the config.json saved with these weights"
# Constant buffers of older saves that no current model holds (GPT-2 under transformers 2 to 4: -1e4 each layer).
CONSTANT_BUFFERS = re.compile(r"(^|\.)attn\.masked_bias$")
POOLER = re.compile(r"(^|\.)pooler\.")
LAYER_INDEX = re.compile(r"\.(?:layer|layers|h|block|blocks)\.(\d+)\.")
LAYER_SETTINGS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
# What sets an attention tensor's shape, as config.json names it (BERT/Llama-style, GPT-2, DistilBERT).
HEAD_SETTINGS = ("num_attention_heads", "num_key_value_heads", "head_dim", "n_head", "n_heads", "multi_query",
                 "hidden_size", "n_embd", "dim")
ATTENTION = re.compile(r"(^|\.)(self_attn|attn|attention)\.")
# Llama-style projections: which dimension of the weight counts heads (rows of q/k/v, columns of o), and which heads.
HEAD_AXIS = {"q_proj": (0, "query"), "k_proj": (0, "key/value"), "v_proj": (0, "key/value"), "o_proj": (1, "query")}


def check_weights_fit(model_dir: Path, config: Mapping[str, Any], model: Any,
                      loading_info: Mapping[str, Iterable[Any]]) -> None:
    """Refuse a model whose ``config.json`` (``config``) does not describe the weights transformers loaded into it.

    ``loading_info`` is what ``from_pretrained(..., output_loading_info=True, ignore_mismatched_sizes=True)``
    returns: tensors of another shape (``mismatched_keys``), tensors the model has no place for
    (``unexpected_keys``) and tensors the weights lack (``missing_keys``), in that order of precedence.
    """
    where = f"{Path(model_dir) / 'config.json'} does not match the weights beside it"
    name = type(model).__name__
    mismatched = sorted(loading_info.get("mismatched_keys") or [], key=lambda m: natural(m[0]))
    if mismatched:
        key, saved, built = mismatched[0]
        more = f" (and {len(mismatched) - 1} more tensors of other shapes)" if len(mismatched) > 1 else ""
        if ATTENTION.search(key):
            settings = ", ".join(f"{k} {config[k]}" for k in HEAD_SETTINGS if k in config)
            raise HeadsweepError(f"{where}: its {settings} make {key} {shape(built)}, but the weights' is "
                                 f"{shape(saved)}{held_heads(key, saved, config)}{more}; {FIX}")
        raise HeadsweepError(f"{where}: the {name} it describes has {key} {shape(built)}, but the weights' is "
                             f"{shape(saved)}{more}; {FIX}")
    unused = [CONSTANT_BUFFERS]
    if getattr(getattr(model, "base_model", None), "pooler", None) is None:
        unused.append(POOLER)
    unexpected = sorted((k for k in loading_info.get("unexpected_keys") or [] if not any(u.search(k) for u in unused)),
                        key=natural)
    if unexpected:
        raise HeadsweepError(f"{where}{layers_note(config, unexpected)}: {len(unexpected)} of their tensors have no "
                             f"place in the {name} it describes and would be dropped ({listed(unexpected)}); {FIX}")
    missing = sorted(loading_info.get("missing_keys") or [], key=natural)
    if missing:
        raise HeadsweepError(f"{where}{layers_note(config, missing)}: the {name} it describes needs {len(missing)} "
                             f"tensors they lack, which transformers would start from random numbers "
                             f"({listed(missing)}); {FIX}")


def natural(key: str) -> tuple:
    """Sort key that puts ``layer.2`` before ``layer.10``."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", key))


def shape(size: Iterable[int]) -> str:
    """``32 x 16``: a tensor's shape as the error line writes it."""
    return " x ".join(str(int(n)) for n in size)


def listed(keys: list[str]) -> str:
    """The first few keys, and how many more."""
    more = f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else ""
    return ", ".join(keys[:SHOWN_KEYS]) + more


def held_heads(key: str, saved: Iterable[int], config: Mapping[str, Any]) -> str:
    """``, 8 query heads of head_dim 4``: the heads a Llama-style projection of the weights holds at the config's
    ``head_dim``; empty where the tensor or the config does not say."""
    head_dim = config.get("head_dim")
    found = HEAD_AXIS.get(key.rsplit(".", 2)[-2] if key.count(".") >= 2 else "")
    dims = list(saved)
    if found is None or not isinstance(head_dim, int) or head_dim <= 0 or len(dims) != 2:
        return ""
    axis, heads = found
    if dims[axis] % head_dim:
        return ""
    return f", {dims[axis] // head_dim} {heads} heads of head_dim {head_dim}"


def layers_note(config: Mapping[str, Any], keys: list[str]) -> str:
    """`` (it says num_hidden_layers 2, the weights hold 3 layers)`` when ``keys`` are all whole layers past the
    config's count (tensors the model has no place for) or the config's last layers (tensors the weights lack);
    else empty."""
    setting = next((k for k in LAYER_SETTINGS if isinstance(config.get(k), int)), None)
    found = [LAYER_INDEX.search(k) for k in keys]
    if setting is None or not all(found):
        return ""
    declared = int(config[setting])
    indices = {int(m.group(1)) for m in found if m}
    if min(indices) >= declared:
        held = max(indices) + 1
    elif indices == set(range(min(indices), declared)):
        held = min(indices)
    else:
        return ""
    return f" (it says {setting} {declared}, the weights hold {held} layers)"
