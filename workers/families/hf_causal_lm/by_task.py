"""What differs by ``data.task``: the data check a run makes before it starts (:func:`check_data`, no model) and
the adapter a worker loads (:func:`load_causal_lm_adapter`, named by the family's registration in
:mod:`.family`). The tasks themselves live in :mod:`.tasks`: perplexity windows, paired prompts, and continuations
(multiple-choice files and lm-evaluation-harness tasks, one scorer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.data.paired_data import read_pairs
from headsweep.workers.data.text_files import check_file, data_file
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.tasks.corpus import read_corpus

if TYPE_CHECKING:
    from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_adapter import LmEvalAdapter
    from headsweep.workers.families.hf_causal_lm.tasks.continuations.multiple_choice import MultipleChoiceAdapter
    from headsweep.workers.families.hf_causal_lm.tasks.paired import PairedAdapter
    from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter


def check_data(cfg: CausalLMData, key: str = "data") -> None:
    """Everything a causal-LM data section (config key ``key``) says that needs no model: its settings, its file,
    for perplexity the corpus text itself (decoded, its rows read), for paired data its pairs."""
    cfg.check()
    if cfg.task == "perplexity":
        read_corpus(cfg, key)
    elif cfg.task == "paired":
        read_pairs(cfg, key)
    elif cfg.task == "lm_eval":  # lm-eval finds the tasks and reads their documents (offline), as the workers will
        from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_scoring import choose_metric
        from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_tasks import load_tasks

        choose_metric(load_tasks(cfg, key), cfg.metric, key)
    else:
        check_file(cfg.path, data_file(key), f"{key}.path")


def load_causal_lm_adapter(model_cfg: CausalLMModel, data_cfg: CausalLMData, runtime: RuntimeOptions
                           ) -> CausalLMAdapter | MultipleChoiceAdapter | PairedAdapter | LmEvalAdapter:
    """Loader named by the ``hf_causal_lm`` model family: by ``data.task``, the perplexity adapter
    (:class:`~.tasks.perplexity.CausalLMAdapter`), (``multiple_choice``)
    :class:`~.tasks.continuations.multiple_choice.MultipleChoiceAdapter`, (``paired``)
    :class:`~.tasks.paired.PairedAdapter` or (``lm_eval``) :class:`~.tasks.continuations.lm_eval_adapter.LmEvalAdapter`.
    Each is imported when asked for: lm-eval (and datasets) load only for runs that use them."""
    if data_cfg.task == "lm_eval":
        from headsweep.workers.families.hf_causal_lm.tasks.continuations.lm_eval_adapter import LmEvalAdapter

        return LmEvalAdapter(model_cfg, data_cfg, runtime)
    if data_cfg.task == "multiple_choice":
        from headsweep.workers.families.hf_causal_lm.tasks.continuations.multiple_choice import MultipleChoiceAdapter

        return MultipleChoiceAdapter(model_cfg, data_cfg, runtime)
    if data_cfg.task == "paired":
        from headsweep.workers.families.hf_causal_lm.tasks.paired import PairedAdapter

        return PairedAdapter(model_cfg, data_cfg, runtime)
    from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter

    return CausalLMAdapter(model_cfg, data_cfg, runtime)
