"""What a submitted job runs on the cluster: its configs written out from the job's environment, then ``headsweep``.

``headsweep submit`` sends the config and its relative includes in the job's runtime_env ``env_vars``
(:data:`~.jobs.BUNDLE_VAR`, JSON ``{"files": {relative path: text}}``), not as an uploaded ``working_dir``: an uploaded
package lives in Ray's GCS under a name derived from its content, and Ray neither uploads an identical package
again nor keeps an expired one (ray-project/ray#46625, #36703), so submitting the same config again, which is how a
lost driver's run continues, could fail in Ray's job start with ``RuntimeEnvSetupError``. Environment variables
travel in the job's config itself. The files are written to a fresh temporary folder that becomes the working
directory, as the unpacked ``working_dir`` was, and removed when the command returns (a command a signal stopped
ends the process at once, leaving the folder's few kilobytes in the node's temporary directory).

Run as ``python -m headsweep.sweep.cluster.job_entry run CONFIG ...`` (the arguments of ``headsweep``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from headsweep.errors import HeadsweepError
from headsweep.sweep.cluster.jobs import BUNDLE_VAR


def bundle_files(text: str) -> dict[str, str]:
    """The files of a bundle (``text``: the JSON of :data:`~.jobs.BUNDLE_VAR`), by relative path; one line naming
    what is wrong with a bundle that ``headsweep submit`` did not make."""
    try:
        bundle = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise HeadsweepError(f"${BUNDLE_VAR} is not the JSON `headsweep submit` writes ({exc}): submit the "
                             "config again with headsweep submit") from None
    files = bundle.get("files") if isinstance(bundle, dict) else None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise HeadsweepError(f"${BUNDLE_VAR} must be a JSON object {{\"files\": {{relative path: text}}}}, as "
                             "headsweep submit writes it: submit the config again with headsweep submit")
    return files


def write_bundle(text: str, dest: Path) -> None:
    """The files of a bundle (``text``: the JSON of :data:`~.jobs.BUNDLE_VAR`) written under ``dest``; a path that is
    absolute or leaves ``dest`` is refused before anything is written."""
    files = bundle_files(text)
    root = dest.resolve()
    targets = []
    for rel in files:
        if not rel or Path(rel).is_absolute() or "\0" in rel:
            raise HeadsweepError(f"config bundle path {rel!r} is not a relative path: a bundle names its files "
                                 "relative to its folder")
        target = (root / rel).resolve()
        if not target.is_relative_to(root) or target == root:
            raise HeadsweepError(f"config bundle path {rel!r} leaves its folder")
        targets.append(target)
    for target, content in zip(targets, files.values(), strict=True):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")


def main(argv: list[str]) -> int:
    """Write the job's configs to a temporary working directory, then run ``headsweep argv`` there."""
    text = os.environ.get(BUNDLE_VAR)
    if text is None:
        print(f"headsweep: error: ${BUNDLE_VAR} is not set: this command runs inside a job that "
              "`headsweep submit` made", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="headsweep-job-"))
    try:
        try:
            write_bundle(text, folder)
        except (HeadsweepError, OSError, UnicodeError) as exc:
            print(f"headsweep: error: {exc}", file=sys.stderr)
            return 2
        os.chdir(folder)
        from headsweep.sweep.terminal.cli import main as headsweep

        return headsweep(argv)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
