"""Benchmark: which transformers architectures headsweep gates exactly, walked from transformers' own auto mappings.

For every text model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ``MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES``
and ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`` it builds a tiny model from the architecture's own config class
(shrunk sizes, seeded weights) and either

* proves every head's gate equal to weight surgery: the family's own sites and hooks (``sites_or_error`` +
  ``HeadGates``, what a run installs on a loaded model) with one head gated off give the logits of a deep copy whose
  output projection has that head's input columns zeroed (no hooks), and mean ablation (the head's mean context as
  its fill) gives the logits of the copy whose columns are zeroed and whose bias gains ``W_O[:, h] @ mean_h``; each
  gated head must change the logits (a gate that did nothing would pass the first check). For ALBERT, whose one
  attention module runs at every depth and is gated per application, the copy is the unrolled twin (one group per
  depth, weights copied), checked equal to the model first, and the surgery is on the application's own module; or
* records headsweep's one-line refusal (a ``HeadsweepError``: no heads, an attention layout no row describes), or
  that no family takes the task yet (sequence-to-sequence), or why the walk skipped the type (vision, audio or
  multimodal; a tiny config that does not build is ``untested``, with transformers' error).

A type is ``wrong`` when a gate differs from its surgery, or a gate changes nothing.

Run: ``python -m bench.coverage`` (``--smoke``: a few types; ``--types a,b``: those; ``--table FILE``: write the
Markdown table docs/families.md carries). Prints one row per type (model type, family, exact / refused and why,
physical pruning, stock export) and ``RESULT coverage causal_lm_exact=<n> seq2seq_exact=<n> classifier_exact=<n>
refused=<n> wrong=<n> untested=<n>``.
"""

from __future__ import annotations

import copy
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from bench import common

SMOKE_TYPES = ("causal_lm:gpt_neox", "causal_lm:mamba", "classifier:modernbert")
TYPE_SECONDS = 60  # a type whose build and proof take longer is untested (timeout)
TOLERANCE = 1e-5  # max |gate - surgery| over the logits, relative to max |logits|
MIN_EFFECT = 1e-7  # a gated head must move the logits by more than this (relative)
TASKS = ("causal_lm", "classifier", "seq2seq")
UNPROVED = "unproved: "  # a problem that is no wrong gate: the head changes nothing by either route
# Model types whose names say they are not text-only, and types that need inputs besides token ids.
NOT_TEXT = ("vision", "audio", "speech", "image", "video", "vl", "omni", "clip", "wav", "whisper", "visual",
            "pix", "layoutlm", "lilt", "markuplm", "udop", "perceiver", "tapas", "pop2piano", "musicgen", "bark")


@dataclass
class Row:
    """One model type's outcome."""

    task: str
    model_type: str
    family: str = "-"
    outcome: str = "untested"  # exact, refused, wrong, skipped, untested
    why: str = ""
    heads: int = 0
    max_diff: float = 0.0
    pruning: str = "-"
    stock: str = "-"

    def markdown(self) -> str:
        return (f"| {self.model_type} | {self.task} | {self.family} | {self.outcome} | {self.pruning} | "
                f"{self.stock} | {self.why.replace('|', '/')} |")


# -- tiny configs -------------------------------------------------------------------------------------------------

WIDTH = {"hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "embed_dim": 64, "n_embed": 64, "d_embed": 64}
HEADS = {"num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "encoder_attention_heads": 4,
         "decoder_attention_heads": 4, "num_attention_heads_per_layer": None}
KV = {"num_key_value_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2, "n_kv_heads": 2}
LAYERS = {"num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "encoder_layers": 2,
          "decoder_layers": 2, "num_decoder_layers": 2}
FFN = {"intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "d_ff": 128, "encoder_ffn_dim": 128,
       "decoder_ffn_dim": 128, "ffn_hidden_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size":
       64, "expert_intermediate_size": 32}
HEAD_SIZE = {"head_dim": 16, "d_kv": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
             "kv_lora_rank": 32, "q_lora_rank": 32, "qk_head_dim": 16}
EXPERTS = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "moe_num_experts": 4, "n_shared_experts": 1, "num_shared_experts": 1, "topk_group": 1, "n_group": 1}
VOCAB = 256
# Hybrids whose default layer pattern puts no attention layer in a 2-layer model: one of each kind.
OVERRIDES = {"jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                       "expert_layer_offset": 1, "use_mamba_kernels": False},
             "bamba": {"attn_layer_indices": [1]},
             # local blocks of 512 tokens pad every input to 512: blocks of 4 keep the proof fast and use both paths
             "pegasus_x": {"block_size": 4, "num_global_tokens": 4}}
NESTED = ("encoder", "decoder")  # sub-configs some encoder-decoder configs hold (T5Gemma), shrunk in turn
TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id", "unk_token_id")


def tiny_kwargs(base) -> dict:
    """Shrunk sizes for a config class whose default instance is ``base``; only keys the class has are set."""
    from transformers import PretrainedConfig

    fields = base.to_dict()
    kwargs: dict = {}
    for table in (WIDTH, HEADS, KV, LAYERS, FFN, HEAD_SIZE, EXPERTS):
        for key, value in table.items():
            if key in fields and value is not None and fields[key] is not None:
                kwargs[key] = value
    if "qk_rope_head_dim" in fields and "head_dim" in fields:  # latent attention: rotary size is head_dim
        kwargs["head_dim"] = kwargs.get("qk_rope_head_dim", fields["qk_rope_head_dim"])
    if "kv_lora_rank" in fields and "num_key_value_heads" in kwargs:  # latent attention expands keys per head
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    for key in ("rotary_dim", "rotary_emb_base_dim"):
        if isinstance(fields.get(key), int):
            kwargs[key] = 8
    if "vocab_size" in fields:
        kwargs["vocab_size"] = VOCAB
    for key in TOKEN_KEYS:
        value = fields.get(key)
        if isinstance(value, int) and value >= VOCAB:
            kwargs[key] = 2
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(fields.get(key), int):
            kwargs[key] = 128
    _tiny_layer_lists(fields, kwargs)
    for key in NESTED:  # T5Gemma: the encoder's and decoder's own configs, shrunk as the top level is
        sub = getattr(base, key, None)
        if isinstance(sub, PretrainedConfig):
            kwargs[key] = {**sub.to_dict(), **tiny_kwargs(sub)}
    return kwargs


def _tiny_layer_lists(fields: dict, kwargs: dict) -> None:
    """Per-layer lists (layer types, hybrid patterns) cut to one layer of each kind the full list has, so a hybrid's
    tiny model keeps an attention layer and a layer without one."""
    layers_key = next((k for k in LAYERS if k in fields and isinstance(fields[k], int)), None)
    if layers_key is None:
        return
    total = fields[layers_key]
    for key, value in fields.items():
        if isinstance(value, list) and len(value) == total and total > 2 and key not in kwargs:
            kinds = list(dict.fromkeys(map(repr, value)))
            firsts = [value[[repr(v) for v in value].index(k)] for k in kinds]
            n = max(2, len(firsts))
            kwargs[key] = (firsts * n)[:n]
            kwargs[layers_key] = n


def tiny_model(task: str, model_type: str, class_name: str) -> nn.Module:
    """The architecture ``class_name`` built from ``model_type``'s config class with shrunk sizes, seeded."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    config = config_class(**{**tiny_kwargs(config_class()), **OVERRIDES.get(model_type, {})})
    if task == "classifier":
        config.num_labels = 3
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config)
    _spread_weights(model)
    return model.eval()


def _spread_weights(model: nn.Module) -> None:
    """Re-draw zero-initialised biases and norms (transformers starts many at 0 or 1), so that a wrong head split or a
    missed bias would show in the logits."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.dim() == 1 and param.is_floating_point():
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


# -- the proof ----------------------------------------------------------------------------------------------------

def inputs(model: nn.Module, task: str) -> dict:
    ids = torch.randint(4, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    if task == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def logits(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**batch, use_cache=False) if "use_cache" in _forward_args(model) else model(**batch)
    return out.logits.double()


def _forward_args(model: nn.Module) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def surgery(model: nn.Module, module_name: str, proj_name: str, columns: slice, fold: torch.Tensor | None
            ) -> nn.Module:
    """A deep copy of ``model`` whose projection ``module_name.proj_name`` has input ``columns`` zeroed, and
    ``fold`` (W_O's columns times the fill) added to its bias: no hooks, weights only."""
    copied = copy.deepcopy(model)
    proj = copied.get_submodule(f"{module_name}.{proj_name}")
    with torch.no_grad():
        conv = not isinstance(proj, nn.Linear)  # transformers' Conv1D: weight (in, out)
        if fold is not None:
            weight = proj.weight.double()
            part = weight[columns, :].T if conv else weight[:, columns]
            add = (part @ fold.double()).to(proj.weight.dtype)
            if proj.bias is None:
                proj.bias = nn.Parameter(add)
            else:
                proj.bias.add_(add)
        if conv:
            proj.weight[columns, :] = 0.0
        else:
            proj.weight[:, columns] = 0.0
    return copied


ALBERT_GROUPS = "albert.encoder.albert_layer_groups"


def unrolled_albert(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """ALBERT's surgery reference: the same model with ``num_hidden_groups = num_hidden_layers``, each group's weights
    copied from the group the model runs at that depth, so every application owns its modules (zeroing one
    application's columns in the shared ``dense`` would zero them in every application); and the attention module
    of each application ``i * inner_group_num + j`` in it (layer ``j`` of group ``i``), by name."""
    config = copy.deepcopy(model.config)
    layers, groups, inner = config.num_hidden_layers, config.num_hidden_groups, config.inner_group_num
    config.num_hidden_groups = layers
    twin = type(model)(config).eval()
    shared = model.state_dict()
    prefix = f"{ALBERT_GROUPS}."
    weights = {}
    for key in twin.state_dict():
        if key.startswith(prefix):
            step, rest = key[len(prefix):].split(".", 1)
            weights[key] = shared[f"{prefix}{int(int(step) / (layers / groups))}.{rest}"]
        else:
            weights[key] = shared[key]
    twin.load_state_dict(weights, strict=True)
    return twin, [f"{prefix}{i}.albert_layers.{j}.attention" for i in range(layers) for j in range(inner)]


def surgery_reference(model: nn.Module, sites) -> tuple[nn.Module, dict]:
    """The model surgery starts from (a copy no hook ever touched) and each site's attention module in it, by name:
    the site's own, or for a module shared across depths (ALBERT) its application's in the unrolled twin."""
    if not any(s.shared is not None for s in sites):
        return copy.deepcopy(model), {s.key: s.module_name for s in sites}
    if not any(name.startswith(ALBERT_GROUPS) for name, _ in model.named_modules()):
        raise RuntimeError("a shared attention module the coverage walk has no unrolled reference for")
    twin, names = unrolled_albert(model)
    return twin, {s.key: names[s.layer] for s in sites}


def prove(model: nn.Module, task: str, sites_of) -> tuple[int, float, str]:
    """Every head: gate == surgery, mean ablation == bias fold. Returns (heads, max relative difference, problem)."""
    from headsweep.workers.core.gates import HeadGates
    from headsweep.workers.core.head_fill import HeadFill
    from headsweep.workers.core.heads import Head

    batch = inputs(model, task)
    gates = HeadGates(sites_of(model))
    reference, names = surgery_reference(model, gates.sites)
    base = logits(model, batch)
    unrolled = any(s.shared is not None for s in gates.sites)
    if unrolled and not torch.equal(logits(reference, batch), base):  # the twin must be the model, unrolled
        return 0, 0.0, "the surgery reference (the unrolled twin) differs from the model before any surgery"
    scale = base.abs().max().item() or 1.0
    contexts: dict = {}

    def record(site):
        def hook(module, args):
            if site.running():  # a module shared across depths: only its own application's call
                contexts[site.key] = args[0].detach().reshape(-1, site.num_heads, site.head_dim)
        return hook

    handles = [s.out_proj.register_forward_pre_hook(record(s)) for s in gates.sites]
    logits(model, batch)
    for h in handles:
        h.remove()
    worst, heads = 0.0, 0
    for site in gates.sites:
        proj_name = site.module_name and _child_name(site.module, site.out_proj)
        mean = contexts[site.key].double().mean(dim=0).to(contexts[site.key].dtype)  # (H, d)
        for h in range(site.num_heads):
            head = Head(site.attention, site.layer, h)
            columns = slice(h * site.head_dim, (h + 1) * site.head_dim)
            with gates.masked([head]):
                gated = logits(model, batch)
            expected = logits(surgery(reference, names[site.key], proj_name, columns, None), batch)
            diff = (gated - expected).abs().max().item() / scale
            effect = (gated - base).abs().max().item() / scale
            if diff > TOLERANCE:
                return heads, diff, f"{head}: gate differs from zeroed columns by {diff:.1e}"
            if effect <= MIN_EFFECT:  # and the surgery agrees (diff): the head outputs nothing here
                return heads, diff, (f"{UNPROVED}{head}: neither its gate nor zeroing its columns changes the tiny "
                                     "model's logits: nothing proved")
            gates.set_fill(HeadFill({site.key: mean}))
            with gates.masked([head]):
                filled = logits(model, batch)
            gates.set_fill(None)
            folded = logits(surgery(reference, names[site.key], proj_name, columns, mean[h]), batch)
            fold_diff = (filled - folded).abs().max().item() / scale
            if fold_diff > TOLERANCE:
                return heads, fold_diff, f"{head}: mean ablation differs from its bias fold by {fold_diff:.1e}"
            worst = max(worst, diff, fold_diff)
            heads += 1
    gates.remove()
    return heads, worst, ""


def _child_name(module: nn.Module, child: nn.Module) -> str:
    for name, sub in module.named_modules():
        if sub is child:
            return name
    raise RuntimeError("the output projection is not inside its attention module")


def pruning_and_stock(model: nn.Module, task: str, sites) -> tuple[str, str]:
    """Whether the family prunes one head of layer 0 physically (with the pruned logits equal to the gated ones),
    and whether a stock config states a uniform removal; "refused: why" otherwise."""
    from headsweep.workers.core.heads import Head
    from headsweep.workers.families.hf_causal_lm.model.sites import kv_groups
    from headsweep.workers.families.registry import model_family

    family = model_family("hf_causal_lm" if task == "causal_lm" else "hf_classifier")
    # Half the heads of every layer, the same in every key/value group (a mask a stock config can state): the first
    # half of each group, or of the groups where a group is one head.
    heads = []
    for site in sites:
        groups = kv_groups([site])[f"self:{site.layer}"]
        size = len(groups[0])
        chosen = [g[: size // 2] for g in groups] if size > 1 else groups[: max(1, len(groups) // 2)]
        heads += [Head("self", site.layer, h) for g in chosen for h in g]
    return pruned_against_gated(family, model, heads, task)


def seq2seq_pruning_and_stock(model: nn.Module, sites) -> tuple[str, str]:
    """As :func:`pruning_and_stock` for an encoder-decoder model: the first half of every module's heads removed
    (every attention type, the same heads in every layer: a mask a T5-style config can state), the pruned logits
    against the gated ones."""
    from headsweep.workers.core.heads import Head
    from headsweep.workers.families.registry import model_family

    family = model_family("hf_seq2seq")
    heads = [Head(s.attention, s.layer, h) for s in sites for h in range(max(1, s.num_heads // 2))]
    return pruned_against_gated(family, model, heads, "seq2seq")


def pruned_against_gated(family, model: nn.Module, heads: list, task: str) -> tuple[str, str]:
    """(physical pruning, stock export) of ``heads`` for ``model``: ``exact`` when the pruned copy's logits on the
    task's batch equal the gated copy's (``WRONG (..)`` otherwise, ``refused`` on the family's one line), then whether
    a stock config states the pruned model (``-`` when pruning was not exact)."""
    from headsweep.errors import HeadsweepError
    from headsweep.workers.core.gates import HeadGates

    batch = inputs(model, task)
    pruned, gated_model = copy.deepcopy(model), copy.deepcopy(model)
    try:
        family.prune(pruned, heads)
        gates = HeadGates(family.find_sites(gated_model))
        with gates.masked(heads):
            want = logits(gated_model, batch)
        got = logits(pruned, batch)
        diff = (got - want).abs().max().item() / (want.abs().max().item() or 1.0)
        pruning = "exact" if diff <= TOLERANCE else f"WRONG ({diff:.1e})"
    except HeadsweepError:
        pruning = "refused"
    except Exception as exc:  # noqa: BLE001 - a pruned model that cannot run is a wrong pruning, shown
        pruning = f"WRONG ({type(exc).__name__})"
    if pruning != "exact":
        return pruning, "-"
    try:
        family.stock_sizes(model, heads)
        return pruning, "yes"
    except HeadsweepError:
        return pruning, "refused"


# -- the walk -----------------------------------------------------------------------------------------------------

def model_types(selected: list[str] | None) -> list[tuple[str, str, str]]:
    """(task, model type, class name) for every entry of the three auto mappings (or the selected ``task:type``)."""
    from transformers.models.auto import modeling_auto as auto

    mappings = {"causal_lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                "classifier": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                "seq2seq": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES}
    rows = [(task, t, c) for task in TASKS for t, c in mappings[task].items()]
    if selected:
        rows = [r for r in rows if f"{r[0]}:{r[1]}" in selected or r[1] in selected]
    return rows


def not_text(model_type: str, class_name: str) -> str | None:
    """Why the walk skips a type that is not text-only, or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        fields = CONFIG_MAPPING[model_type]().to_dict()
    except Exception:  # noqa: BLE001 - a config that cannot build at its defaults is found out by tiny_model
        fields = {}
    nested = [f for key in NESTED if isinstance(f := fields.get(key), dict)]  # T5Gemma 2's encoder reads images
    sub = [k for f in (fields, *nested) for k in ("vision_config", "audio_config", "speech_config", "image_config",
                                                  "encoder_config", "text_config", "vq_config") if k in f]
    if sub:
        return f"multimodal ({sub[0]})"
    lowered = f"{model_type} {class_name}".lower()
    hit = next((w for w in NOT_TEXT if w in lowered), None)
    return f"not a text model ({hit})" if hit else None


def check(task: str, model_type: str, class_name: str) -> Row:
    from headsweep.errors import HeadsweepError

    row = Row(task, model_type)
    why = not_text(model_type, class_name)
    if why:
        row.outcome, row.why = "skipped", why
        return row
    try:
        model = tiny_model(task, model_type, class_name)
        logits(model, inputs(model, task))
    except Exception as exc:  # noqa: BLE001 - transformers' own errors on a shrunk config: the type is untested
        row.why = f"tiny config did not build or run: {first_line(exc)}"
        return row
    if task == "seq2seq":
        from headsweep.workers.families.hf_seq2seq.sites import seq2seq_sites_or_error as sites_or_error
        row.family = "hf_seq2seq"
    elif task == "causal_lm":
        from headsweep.workers.families.hf_causal_lm.model.sites import sites_or_error
        row.family = "hf_causal_lm"
    else:
        from headsweep.workers.families.hf_classifier.adapter import _sites_or_error as sites_or_error
        row.family = "hf_classifier"
    try:
        sites = sites_or_error(model)
    except HeadsweepError as exc:
        row.outcome, row.why = "refused", first_line(exc)
        return row
    try:
        heads, diff, problem = prove(model, task, sites_or_error)
    except HeadsweepError as exc:
        row.outcome, row.why = "refused", first_line(exc)
        return row
    except Exception as exc:  # noqa: BLE001 - a gate that breaks the forward is a wrong gate, shown with its error
        row.outcome, row.why = "wrong", f"gated forward failed: {first_line(exc)}"
        return row
    row.heads, row.max_diff = heads, diff
    if problem:
        unproved = problem.startswith(UNPROVED)
        row.outcome, row.why = ("untested" if unproved else "wrong"), problem.removeprefix(UNPROVED)
        return row
    row.outcome = "exact"
    if task == "seq2seq":
        row.pruning, row.stock = seq2seq_pruning_and_stock(model, sites)
        return row
    from headsweep.workers.families.hf_shared.sites import headless_layers
    none = headless_layers(model, sites)
    if none:
        row.why = f"layers without heads: {', '.join(map(str, none))}"
    row.pruning, row.stock = pruning_and_stock(model, task, sites)
    return row


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


class _Timeout(BaseException):  # not an Exception: the checks' own handlers must let it through
    pass


_ARMED = [False]  # whether a type's check is running: an alarm delivered after it ended is ignored


def _alarm(*_args) -> None:
    if _ARMED[0]:
        raise _Timeout


def run(selected: list[str] | None, tasks: list[str], type_seconds: int = TYPE_SECONDS) -> list[Row]:
    """Check every selected type of ``tasks``; a type whose build and proof take over ``type_seconds`` is untested."""
    rows = []
    signal.signal(signal.SIGALRM, _alarm)
    for task, model_type, class_name in model_types(selected):
        if task not in tasks:
            continue
        start = time.perf_counter()
        try:  # a timeout raised while the inner block ends (the alarm's handler runs late) is caught here too
            _ARMED[0] = True
            signal.alarm(type_seconds)
            try:
                row = check(task, model_type, class_name)
            finally:
                _ARMED[0] = False
                signal.alarm(0)
        except _Timeout:
            row = Row(task, model_type, why=f"took over {type_seconds} s")
        rows.append(row)
        detail = f"{row.heads} heads, max rel. diff {row.max_diff:.1e}" if row.outcome == "exact" else ""
        common.log(f"{row.task:10} {row.model_type:28} {row.family:13} {row.outcome:8} {row.pruning:8} {row.stock:8} "
                   f"{time.perf_counter() - start:5.1f}s {row.why or detail}")
    return rows


def table(rows: list[Row]) -> str:
    head = ("| model type | task | family | outcome | physical pruning | stock export | why |\n"
            "| --- | --- | --- | --- | --- | --- | --- |")
    return "\n".join([head, *(r.markdown() for r in rows)])


def main() -> None:
    parser = common.command_line(__doc__)
    parser.add_argument("--types", default="", help="comma-separated model types (or task:type) to check")
    parser.add_argument("--table", type=Path, help="write the Markdown table here")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks to walk (default: all)")
    parser.add_argument("--type-seconds", type=int, default=TYPE_SECONDS,
                        help=f"a type taking longer is untested (default {TYPE_SECONDS}; raise it on a loaded machine)")
    args = parser.parse_args()
    smoke = common.enable_smoke(args)
    common.quiet_logging()
    torch.set_num_threads(1)
    selected = [t for t in args.types.split(",") if t] or (list(SMOKE_TYPES) if smoke else None)
    rows = run(selected, args.tasks.split(","), args.type_seconds)
    if args.table:
        args.table.write_text(table(rows) + "\n")
    count = {o: sum(r.outcome == o for r in rows) for o in ("refused", "wrong", "untested", "skipped")}
    exact = {t: sum(r.outcome == "exact" and r.task == t for r in rows) for t in TASKS}
    common.result("coverage", causal_lm_exact=exact["causal_lm"], seq2seq_exact=exact["seq2seq"],
                        classifier_exact=exact["classifier"], refused=count["refused"], wrong=count["wrong"],
                        untested=count["untested"], skipped=count["skipped"])


if __name__ == "__main__":
    main()
