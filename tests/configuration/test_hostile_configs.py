"""Configs a shared service must survive: an alias bomb, an oversized file, a key given twice; and the numbers
every user writes (``1e-3``) read as numbers. Each refusal through the real CLI: one line, exit 2, nothing written,
and (for the bomb) within a few megabytes of what the CLI takes anyway."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, error_line, run_cli

from headsweep.errors import HeadsweepError
from headsweep.sweep.configuration.config import apply_overrides, build_config, load_config
from headsweep.sweep.configuration.yaml_text import MAX_CONFIG_BYTES

# Nine nested aliases: about 30 bytes a level, 9**9 = 387 million strings once expanded.
BOMB = "a: &a [" + ", ".join(["lol"] * 9) + "]\n" + "".join(
    f"{c}: &{c} [" + ", ".join([f"*{p}"] * 9) + "]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
) + "name: *i\n"


def base_config(tmp_path) -> dict:
    return {"model": {"kind": "hf_classifier", "path": str(tmp_path / "model")},
            "data": {"path": str(tmp_path / "dev.tsv")}}


def optimal_config(tmp_path) -> dict:
    """A config whose ablation reads ``ablation.lr``."""
    return {**base_config(tmp_path), "sweep": {"ablation": "optimal"},
            "ablation": {"reference": {"path": str(tmp_path / "train.tsv")}}}


def peak_rss_mib(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI run in a process of its own, and the peak resident memory of that run (its children's maximum)."""
    probe = ("import json, resource, subprocess, sys\n"
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "print(json.dumps([p.returncode, p.stdout, p.stderr, "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]))\n")
    out = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "headsweep", *args],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    code, stdout, stderr, peak = json.loads(out.stdout)
    return subprocess.CompletedProcess(args, code, stdout, stderr), peak


def test_an_alias_bomb_is_refused_in_one_line_within_a_few_megabytes(tmp_path):
    assert BOMB.startswith("a: &a [lol, lol,") and "i: &i [*h, *h," in BOMB
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    plain = tmp_path / "plain.yaml"
    plain.write_text("name: [lol]\n")
    # The same CLI on a harmless config that fails as early: its memory is the reference.
    proc, peak = peak_rss_mib("run", str(bomb), "--store", str(tmp_path / "store"))
    reference, reference_peak = peak_rss_mib("run", str(plain), "--store", str(tmp_path / "store"))
    assert reference.returncode == 2
    assert proc.returncode == 2, proc.stderr
    assert error_line(proc.stderr) == (
        f"headsweep: error: config file {bomb}: line 2, column 8: YAML alias *a is not accepted in configs (aliases "
        "can expand without bound); share values between configs with include: instead")
    assert "Traceback" not in proc.stderr and not (tmp_path / "store").exists()
    assert peak < reference_peak + 16, (peak, reference_peak)
    # submit reads the config (and its includes) on the client the same way, before any cluster is asked.
    submitted = run_cli("submit", str(bomb), "--address", "http://127.0.0.1:9")
    assert submitted.returncode == 2 and "YAML alias *a is not accepted in configs" in error_line(submitted.stderr)
    # An override is YAML too.
    with pytest.raises(HeadsweepError, match=r"bad override 'name=\[&x \[1\], \*x\]': YAML alias \*x is not"):
        apply_overrides({}, ["name=[&x [1], *x]"])


def test_a_config_file_is_bounded_in_size(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("name: x\n" + "#" * MAX_CONFIG_BYTES)
    proc = run_cli("run", str(big), "--store", str(tmp_path / "store"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert error_line(proc.stderr) == (
        f"headsweep: error: config file {big} is {big.stat().st_size:,} bytes; a config is at most "
        f"{MAX_CONFIG_BYTES:,} bytes (data and lists of masks belong in files the config names)")


def test_a_key_given_twice_is_refused_where_it_is_given(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("model: {kind: hf_classifier, path: m}\ndata:\n  path: a.tsv\n  path: b.tsv\n"
                     "sweep: {workers: 1}\n")
    proc = run_cli("run", str(twice), "--store", str(tmp_path / "store"))
    assert proc.returncode == 2
    assert error_line(proc.stderr) == (f"headsweep: error: config file {twice}: line 4, column 3: key 'path' is given "
                                       "twice (first on line 3)")
    # Top-level sections likewise; the same key in two different sections is fine.
    (tmp_path / "sections.yaml").write_text("sweep: {workers: 1}\nname: x\nsweep: {workers: 3}\n")
    with pytest.raises(HeadsweepError, match="line 3, column 1: key 'sweep' is given twice"):
        load_config(tmp_path / "sections.yaml")
    # An included file may set what its includer sets: that is what include is for, not a repetition.
    (tmp_path / "inc.yaml").write_text("sweep: {workers: 3}\n")
    (tmp_path / "top.yaml").write_text(yaml.safe_dump({**base_config(tmp_path), "include": "inc.yaml",
                                                       "sweep": {"workers": 1}}))
    assert load_config(tmp_path / "top.yaml").sweep.workers == 1


@pytest.mark.parametrize("written", ["1e-3", "1.0e-3", "1E-3", "+1e-3", ".1e-2"])
def test_scientific_notation_is_a_number_in_files_and_overrides(tmp_path, written):
    text = yaml.safe_dump(optimal_config(tmp_path)).replace("ablation:\n", f"ablation:\n  lr: {written}\n", 1)
    (tmp_path / "c.yaml").write_text(text)
    assert load_config(tmp_path / "c.yaml").ablation.lr == 0.001
    assert build_config(apply_overrides(optimal_config(tmp_path), [f"ablation.lr={written}"])).ablation.lr == 0.001
    assert build_config(apply_overrides(base_config(tmp_path), [f"significance.alpha={written}"])).significance.alpha \
        == 0.001
    # Only where a number is asked for: text stays text (a revision that looks like a number is not one).
    with pytest.raises(HeadsweepError, match="must be float, got '1e-3x'"):
        build_config(apply_overrides(optimal_config(tmp_path), ["ablation.lr=1e-3x"]))
