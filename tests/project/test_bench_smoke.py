"""Every benchmark under bench/ in its ``--smoke`` mode, run as users run it (``python -m bench.X`` from the
repository root, a subprocess); and no file under bench/ patches ``sys.path``.

A benchmark that no test runs rots unnoticed (``bench/grid_speed.py`` crashed after its translation
part and lost the classifier figure it had measured). Smoke mode takes each benchmark's own code path on tiny
models and data (``bench/common.py``); here each must exit 0 and print its RESULT lines, well formed, in order.
The tiny models are cached in one folder for the module (``HEADSWEEP_BENCH_CACHE``), so the Multi30k benchmarks
train theirs once, and nothing lands in ``~/.cache``. Benchmarks that need ``../shared/data`` skip without it
(after checking that they say so and exit 0).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
# bench/common.py by its path: the suite does not put the repository root on sys.path.
_spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

SHARED_DATA = REPO.parent / "shared" / "data"

# Script -> the RESULT names its smoke run prints, in order.
SMOKE = {
    "ablation_methods": ["ablation_methods"] * 3,  # classifier, lm, multi30k (the last needs ../shared/data)
    "coverage": ["coverage"],  # three model types: one proved exact, one refused (Mamba), one classifier
    "dispatch": ["dispatch", "dispatch_balance"],
    "grid_speed": ["grid_classifier", "grid_translation"],
    "interrupt_stress": ["interrupt_stress"],  # a clean run, then Ctrl-C mid-grid and the resume, equal
    "lm_grid": ["lm_grid"],  # TransformerLens is not a dependency: its line is not expected
    "lm_eval_grid": ["lm_eval_grid"],  # six questions on a 2-layer model: lm-eval loop, plain, reuse
    "multi30k_hf_seq2seq": ["multi30k_hf_seq2seq"],  # a 1+1-layer Marian trained 6 s, then baseline and grid
    "multi30k_l0": ["l0"],
    "multi30k_pruning": ["multi30k_pruning"],
    "multi30k_roles": ["roles"],
    "multi30k_translation": ["multi30k_grid"],
    "peers": ["peers"],  # with this python, whose peers are absent: headsweep's routes and `headsweep run` alone
    "peers_classifier": ["peers_classifier"],  # the same for BERT, without `headsweep run` (peers' smoke runs it)
    "prune_speed": ["prune_speed", "prune_speed"],  # batch sizes 1 and 64
    "real_size": ["real_size"] * 2,  # bert-base, llama-3.2-1b (one shape per family)
    "report_scale": ["report_scale"],  # a synthetic store's report opened in headless Chromium
    "screening": ["screening_classifier", "screening_rates_classifier", "screening"],
    "significance": ["significance"],
    "soak": ["soak"],  # 64 evaluations, one worker killed
    "stock_export": ["stock_export"] * 3,  # qwen2.5-0.5b at 50% (25% is no whole group), llama-3.2-1b at 25%, 50%
    "translation_vs_fairseq": ["translation_vs_fairseq"],
    "vocab_slices": ["vocab_slices"],  # one tiny LM head: whole logits against slices
}
# These print SKIP and exit 0 without ../shared/data (the others fall back to generated data).
NEEDS_DATA = {"lm_grid", "multi30k_hf_seq2seq", "multi30k_l0", "multi30k_pruning", "multi30k_roles",
              "multi30k_translation", "translation_vs_fairseq"}
# These print their other RESULT lines without ../shared/data, and SKIP for the part that needs it: the number of
# (last) RESULT lines that part prints.
DATA_PART = {"ablation_methods": 1}
# bench/ files that are not benchmarks with a smoke mode, and why.
NOT_SMOKED = {
    "common": "the benchmarks' shared module, exercised by every smoke run",
    "slow_tests": "runs the suite's slow tests (pytest -m slow); a tiny version would test nothing",
    "gpu_check": "GPU checks, tested by their own test",
    "__init__": "the package's docstring",
    "browser": "headless Chromium for report_scale and the browser tests, exercised by the browser tests "
               "(tests/reporting/test_explorer_browser.py) and report_scale's smoke run (slow)",
    "synthetic_store": "report_scale's synthetic store (also the browser tests'), exercised by the browser tests and "
                       "its smoke run (slow)",
    "classifier": "the BERT classifiers of real_size, grid_speed and screening, exercised by their smoke runs",
    "run_phases": "headsweep run with a stopwatch on the driver's phases, exercised by peers' full smoke run "
                  "(peers-run, slow)",
    "flops": "FLOP counts and the matrix-product rate of real_size and lm_grid, exercised by their smoke runs (slow)",
    "measure": "memory and grid timing of grid_speed, lm_grid and translation_vs_fairseq, exercised by their smoke "
               "runs (slow)",
    "multi30k": "the Multi30k data and models of the Multi30k benchmarks, exercised by their smoke runs",
    "sweeps": "sweeps run and watched for real_size and ablation_methods, exercised by their smoke runs",
}
# Arguments a smoke run adds: bench/peers.py would switch to .venv-peers' python where that exists; the suite's run
# is of this python, without the peers (test_peers_smoke_in_the_peers_venv runs them).
SMOKE_ARGS = {"peers": ["--no-reexec"], "peers_classifier": ["--no-reexec", "--skip-run"]}
# Smoke cases that run a script with other arguments, by case id: (script, its arguments). peers' routes on the
# LM (its own glue) stay in the suite without `headsweep run` end to end (20 s of its 35 s: a driver, Ray and a
# worker); the whole run, bench/run_phases.py's stopwatch included, is the slow case peers-run.
VARIANTS = {"peers": ("peers", ["--no-reexec", "--skip-run", "--packed", "2"]), "peers-run": ("peers", ["--no-reexec"])}
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
RESULT_LINE = re.compile(r"^RESULT ([a-z0-9_]+)((?: [a-z0-9_]+=\S+)+)$")


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-cache")


# Smoke runs longer than the others' 300 s bound allows on a busy machine: interrupt_stress runs the CLI three times
# (a clean run, a stopped run, its resumption), each starting a driver and a worker (50-80 s apiece at a load
# average of 20).
TIMEOUT_S = {"interrupt_stress": 600}


def run_smoke(script: str, cache: Path, python: str = sys.executable, *args: str,
              smoke_args: list[str] | None = None) -> subprocess.CompletedProcess:
    """``python -m bench.SCRIPT --smoke`` with ``smoke_args`` (default: ``SMOKE_ARGS``') and ``args``."""
    smoke_args = SMOKE_ARGS.get(script, []) if smoke_args is None else smoke_args
    return subprocess.run([python, "-m", f"bench.{script}", "--smoke", *smoke_args, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S.get(script, 300),
                          env={**os.environ, "HEADSWEEP_BENCH_CACHE": str(cache)})


def results(stdout: str) -> list[tuple[str, dict[str, str]]]:
    """The RESULT lines of ``stdout`` as (name, fields); a line starting RESULT that is malformed fails."""
    found = []
    for line in stdout.splitlines():
        if not line.startswith("RESULT"):
            continue
        match = RESULT_LINE.match(line)
        assert match, f"malformed RESULT line: {line!r}"
        fields = dict(f.split("=", 1) for f in match.group(2).split())
        found.append((match.group(1), fields))
    return found


# Smoke runs with a test file of their own (test_bench_smoke_real_size.py): the suite's two test processes take a
# file each, and real_size's run (about 150 s) behind this file's others would end the suite on one process.
OWN_FILE = {"real_size"}


# Smoke runs kept out of the suite's 20 minutes (run by ``python -m bench.slow_tests``, ``-m slow``): each takes
# 16-65 s on two cores and its benchmark's code paths are the product's, which the suite's own tests cover faster
# (named here); the benchmark's own glue is what only its smoke run checks.
SLOW_SMOKE = {
    "ablation_methods": "the five methods against surgery: tests/contract/test_ablation_methods.py",
    "soak": "a worker killed mid-grid: tests/run/test_fault_tolerance.py",
    "real_size": "real shapes of each family: tests/contract/ on tiny shapes, tests/project/test_gpu_check.py",
    "screening": "screening's rates and kept heads: tests/run/test_screening.py",
    "dispatch": "the actor pool and its balance: tests/run/test_dispatch_balance.py",
    "interrupt_stress": "a stop at any line the store runs, then a resume: tests/run/test_chunk_interrupts.py, "
                        "tests/run/test_resume.py",
    "lm_eval_grid": "lm-eval's own simple_evaluate against the adapter's paths: "
                    "tests/families/causal_lm/test_lm_eval_tasks.py",
    "grid_speed": "reuse against the plain path in both families: tests/families/translation/, "
                  "tests/families/classifier/",
    # Five Multi30k benchmarks (each 11-18 s); multi30k_translation's smoke run keeps bench/multi30k.py's data,
    # training and cache in the suite.
    "multi30k_l0": "L0 gates on fairseq through the CLI: tests/experiments/test_l0_gates.py::"
                   "test_two_lambda_tune_run_on_fairseq_through_the_cli, "
                   "test_fairseq_gates_on_encoder_self_attention_with_the_checkpoints_label_smoothing",
    "multi30k_pruning": "translation importance and pruning: tests/experiments/test_importance.py::"
                        "test_translation_importance_ignores_padding_and_matches_the_task_loss, "
                        "tests/families/translation/test_translation_sweep.py (pruned export), "
                        "tests/experiments/test_prune_cli.py",
    "multi30k_roles": "fairseq head roles and syntax: tests/experiments/test_head_roles.py::"
                      "test_fairseq_roles_with_dictionary_counts, tests/experiments/test_syntactic_heads.py::"
                      "test_fairseq_enc_self_against_argmax_by_hand",
    "translation_vs_fairseq": "every head's beam search against fairseq's with zeroed columns: "
                              "tests/families/translation/test_translation.py::"
                              "test_every_head_gated_beam_search_equals_zeroed_columns, "
                              "tests/families/translation/test_translation_speed_paths.py",
    "lm_grid": "an LM's single-head grid, reuse against the plain path: tests/families/causal_lm/"
               "test_causal_lm_reuse.py::test_reuse_equals_plain_for_every_head_and_all_but_one",
    "stock_export": "pruned causal LMs exported and reloaded: tests/families/causal_lm/test_causal_lm_pruning.py "
                    "(test_save_and_load_pruned, test_export_cli_of_a_causal_lm)",
    "multi30k_hf_seq2seq": "a Marian model's grid: tests/families/seq2seq/test_seq2seq_sweep.py::"
                           "test_every_head_of_every_attention_type_with_chrf_from_its_stored_hypotheses",
    "prune_speed": "heads physically removed and timed against the full model: tests/experiments/"
                   "test_prune_cli.py::test_efficiency_rows; pruned equals gated: tests/contract/"
                   "test_family_contract.py::test_pruned_equals_gated",
    "report_scale": "a synthetic store's report in headless Chromium (bench/synthetic_store.py, bench/browser.py): "
                    "tests/reporting/test_explorer_browser.py",
    "coverage": "each family's gates against weight surgery: tests/families/causal_lm/test_causal_lm_gates.py::"
                "test_gate_equals_zeroed_output_projection, tests/contract/; state-space models refused: "
                "tests/families/test_attention_sites.py::"
                "test_models_without_heads_or_with_undescribed_attention_are_refused",
    "peers-run": "a causal LM's headsweep run end to end: tests/families/causal_lm/test_causal_lm_reuse.py::"
                 "test_a_sweep_reports_reuse_and_equals_the_plain_path; peers' routes: the peers case here "
                 "(--skip-run)",
}


def _smoke_case(case: str):
    return pytest.param(case, marks=pytest.mark.slow) if case in SLOW_SMOKE else case


@pytest.mark.parametrize("case", [_smoke_case(s) for s in sorted(set(SMOKE) - OWN_FILE | set(VARIANTS))])
def test_smoke(case: str, bench_cache: Path) -> None:
    script, smoke_args = VARIANTS.get(case, (case, None))
    proc = run_smoke(script, bench_cache, smoke_args=smoke_args)
    assert proc.returncode == 0, (f"{script} --smoke exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-5000:]}")
    if script in NEEDS_DATA and not (SHARED_DATA / "multi30k").is_dir():
        assert re.search(r"^SKIP \w+: .*not found", proc.stdout, re.M), proc.stdout[-2000:]
        pytest.skip(f"{SHARED_DATA} absent: {script} skips")
    expected = SMOKE[script]
    if script in DATA_PART and not (SHARED_DATA / "multi30k").is_dir():
        assert re.search(r"^SKIP \w+ .*not found", proc.stdout, re.M), proc.stdout[-2000:]
        expected = expected[: -DATA_PART[script]]
    found = results(proc.stdout)
    assert [name for name, _ in found] == expected, proc.stdout[-3000:]
    for name, fields in found:
        assert fields, f"RESULT {name} has no key=value fields"
    if script == "grid_speed":
        # Each part's line as soon as it is measured: the classifier's before the translation part starts.
        lines = proc.stdout.splitlines()
        first = lines.index(next(x for x in lines if x.startswith("RESULT grid_classifier ")))
        assert first < lines.index(next(x for x in lines if x.startswith("translation: "))), proc.stdout[-3000:]
        assert found[1][1]["identical_hypotheses"] == "true"
    if script == "soak":
        # The kill landed, and the faulted run stored every evaluation once, each number as the uninterrupted run's.
        assert {k: found[0][1][k] for k in ("masks", "kills", "lost", "duplicated", "equal")} == {
            "masks": "64", "kills": "1", "lost": "0", "duplicated": "0", "equal": "true"}, proc.stdout[-3000:]
    if script == "coverage":
        # Every gate proved against weight surgery or refused in one line; none wrong, none left untested.
        assert {k: found[0][1][k] for k in ("causal_lm_exact", "classifier_exact", "refused", "wrong", "untested")} \
            == {"causal_lm_exact": "1", "classifier_exact": "1", "refused": "1", "wrong": "0", "untested": "0"}, \
            proc.stdout[-3000:]
        assert re.search(r"^causal_lm +mamba +hf_causal_lm +refused .*state-space", proc.stdout, re.M), proc.stdout
    if script == "peers":
        peers_absent = all(f"peers: {route} not run:" in proc.stdout for route in ("transformerlens", "nnsight_loop",
                                                                                     "nnsight_batched"))
        fields = found[0][1]
        if peers_absent:  # each peer says why in one line, and headsweep's figures still print
            assert {k: fields[k] for k in ("vs_transformerlens", "vs_nnsight_loop", "vs_nnsight_batched")} == {
                "vs_transformerlens": "n/a", "vs_nnsight_loop": "n/a", "vs_nnsight_batched": "n/a"}, proc.stdout
        assert fields["equal"] == "true" and float(fields["bound"]) > 1, proc.stdout[-3000:]
        if case == "peers":  # --skip-run: no `headsweep run`, so no start-up figure (peers-run measures it)
            assert fields["startup_s"] == "n/a" and not re.search(r"^  one_minute run phase ", proc.stdout, re.M), \
                proc.stdout[-3000:]
            # --packed 2: the default route again with two masks a pass, timed and as exact as the others
            assert re.search(r"^  one_minute packed +[\d.]+ s ", proc.stdout, re.M) and re.search(
                r"equal: largest \|log perplexity - plain's\| default \S+, packed \S+", proc.stdout), \
                proc.stdout[-3000:]
            packed = fields["packed_vs_fastest"]
            assert packed == "n/a" if peers_absent else float(packed) > 0, proc.stdout[-3000:]
        else:
            assert fields["packed_vs_fastest"] == "n/a", proc.stdout[-3000:]  # no --packed: the route is not run
            # `headsweep run` ran and said when its worker was ready, or the bench said in one line why it could not
            # (a Ray that does not start on an overloaded machine is not the benchmark's to hide)
            assert (fields["startup_s"] != "n/a" and float(fields["startup_s"]) > 0) or re.search(
                r"^peers: run not measured: headsweep run exited \d+: \S", proc.stdout, re.M), proc.stdout[-3000:]
            if fields["startup_s"] != "n/a":  # the driver's phases (bench/run_phases.py), Ray's start among them
                assert re.search(r"^  one_minute run phase ray\.init +at +[\d.]+ s: +[\d.]+ s$", proc.stdout,
                                 re.M), proc.stdout[-3000:]
    if script == "interrupt_stress":
        # Ctrl-C once the run had stored some of its evaluations (its own progress, read from the store): a live
        # run stopped, its store holding the invariant, resumed, and equal to the clean run's.
        fields = found[0][1]
        assert {k: fields[k] for k in ("trials", "violations", "resumed", "equal", "finished_first", "sigint")} == {
            "trials": "1", "violations": "0", "resumed": "1", "equal": "1", "finished_first": "0", "sigint": "1"
        }, proc.stdout[-3000:]
    if script == "ablation_methods":
        # The LM's hook loop (mean ablation on hook_z, written in the script) gave headsweep's deltas.
        assert found[1][1]["model"] == "lm" and found[1][1]["hook_loop_equal"] == "true", proc.stdout[-3000:]


@pytest.mark.skipif(not PEERS_PYTHON.exists(), reason="no .venv-peers here (make bench-peers makes it)")
def test_peers_smoke_in_the_peers_venv(bench_cache: Path) -> None:
    """bench/peers.py's smoke run with TransformerLens and nnsight present: every peer route runs and agrees with
    headsweep's plain path (``headsweep run`` left out: test_smoke runs it)."""
    proc = run_smoke("peers", bench_cache, str(PEERS_PYTHON), "--skip-run", "--packed", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not run" not in proc.stdout, proc.stdout[-3000:]
    (name, fields), = results(proc.stdout)
    assert name == "peers" and fields["equal"] == "true", proc.stdout[-3000:]
    for route in ("vs_transformerlens", "vs_nnsight_loop", "vs_nnsight_batched", "packed_vs_fastest"):
        assert float(fields[route]) > 0, (route, proc.stdout[-3000:])
    assert re.search(r"equal: largest \|log perplexity - plain's\| default \S+, packed \S+, transformerlens \S+, "
                     r"nnsight_loop \S+, nnsight_batched \S+; bound", proc.stdout), proc.stdout[-3000:]


def test_every_benchmark_has_a_smoke_case() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py")}
    assert scripts - set(SMOKE) - set(NOT_SMOKED) == set(), "a benchmark without a smoke case here"
    assert set(SMOKE) <= scripts


def test_result_line_refuses_what_the_test_could_not_parse(capsys) -> None:
    line = common.result("x_y", ratio="1.50", identical="3/4", n=2)
    assert line == "RESULT x_y ratio=1.50 identical=3/4 n=2"
    assert capsys.readouterr().out == line + "\n"
    for bad in ({"ratio": ""}, {"note": "two words"}):
        with pytest.raises(ValueError, match="empty or spaced"):
            common.result("x", **bad)


def path_patches(source: str) -> list[int]:
    """The lines of ``source`` that touch ``sys.path`` (insert, assign, extend, read)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys"]


def test_no_benchmark_patches_sys_path() -> None:
    """The benchmarks run as modules of the ``bench`` package (``python -m bench.X``) and import their support
    modules as ``bench.*``: none puts a folder on ``sys.path`` (bench/ there puts every benchmark's name, ``common``
    among them, before every other module's)."""
    patched = {str(p.relative_to(REPO)): lines for p in sorted(BENCH.rglob("*.py"))
               if (lines := path_patches(p.read_text(encoding="utf-8")))}
    assert patched == {}, f"sys.path patched at (file: lines) {patched}"
    assert path_patches("import sys\nsys.path[:0] = ['x']\n") == [2]
    assert path_patches("import sys\nfrom pathlib import Path\nsys.path.insert(0, str(Path.cwd()))\n") == [3]
