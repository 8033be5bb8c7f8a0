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

from headsweep.sweep.cluster.jobs import BUNDLE_VAR


def write_bundle(text: str, dest: Path) -> None:
    """The files of a bundle (``text``: the JSON of :data:`~.jobs.BUNDLE_VAR`) written under ``dest``."""
    files = json.loads(text)["files"]
    for rel, content in files.items():
        target = (dest / rel).resolve()
        if not target.is_relative_to(dest.resolve()):
            raise ValueError(f"config bundle path {rel!r} leaves its folder")
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
        write_bundle(text, folder)
        os.chdir(folder)
        from headsweep.sweep.terminal.cli import main as headsweep

        return headsweep(argv)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
