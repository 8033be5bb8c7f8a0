"""A results store on S3: the sweep writes through pyarrow's S3 filesystem to a real S3 endpoint.

The endpoint is moto's S3 server on loopback (the S3 wire protocol, no cloud account), so the
same code path as `--store s3://bucket/prefix` on AWS, MinIO or Ceph is exercised end to end.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs as pafs
import pytest
import yaml
from conftest import error_line, run_cli, sweep_in_process
from s3_server import CREDENTIALS, s3_server

from headsweep.results.store import ResultStore


@pytest.fixture(scope="module")
def s3_endpoint(monkeypatch_module):
    """A real S3 endpoint (moto's S3 server) on a free loopback port."""
    with s3_server(monkeypatch_module) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_sweep_writes_and_queries_a_store_on_s3(tmp_path, s3_endpoint, tiny_bert_dir, tiny_dev_tsv, ray_address):
    fs = pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http", region="us-east-1",
                           access_key="testing", secret_key="testing", allow_bucket_creation=True)
    fs.create_dir("sweeps")  # the bucket
    uri = f"s3://sweeps/team/store?endpoint_override={s3_endpoint}&scheme=http&region=us-east-1"
    cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)},
           "sweep": {"experiments": ["baseline", "single_head"], "flush_every": 3}}
    # The driver in this process (the credentials are in its environment): what writes the store is the driver's
    # code, as under `headsweep run` (whose `--store s3://` refusal is the next test's).
    run_id = sweep_in_process(cfg, tmp_path, "c", uri, ray_address)

    store = ResultStore(uri)
    evals = store.read("evaluations", run_id).to_pylist()
    assert sorted(e["eval_id"] for e in evals) == ["baseline"] + [f"single_head/self:{la}:{h}" for la in range(2)
                                                                   for h in range(4)]
    assert store.read("examples", run_id).num_rows == 9 * 40
    assert store.run(run_id)["status"] == "complete"
    keys = [i.path for i in fs.get_file_info(pafs.FileSelector("sweeps/team/store", recursive=True))]
    assert not [k for k in keys if k.rsplit("/", 1)[-1].startswith(".")]  # no temporary objects left behind
    assert any(k.startswith(f"sweeps/team/store/evaluations/run_id={run_id}/chunk-") for k in keys)

    query = run_cli("query", "SELECT count(*) AS n, max(delta) <= 0 AS ok FROM evaluations", "--store", uri,
                    "--format", "json", env=CREDENTIALS)
    assert query.returncode == 0, query.stderr
    assert '"n": 9' in query.stdout


def test_unreachable_s3_store_is_a_one_line_error(tmp_path, tiny_bert_dir, tiny_dev_tsv):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    cfg = {"model": {"kind": "hf_classifier", "path": str(tiny_bert_dir)}, "data": {"path": str(tiny_dev_tsv)}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    uri = f"s3://sweeps/store?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    commands = [("run", str(tmp_path / "c.yaml")), ("runs",), ("query", "SELECT count(*) FROM evaluations"),
                ("report", "some-run")]
    # At once: each spends most of its 6 s in the S3 client's retry pauses, not on a core.
    with ThreadPoolExecutor(len(commands)) as pool:
        procs = list(pool.map(lambda args: run_cli(*args, "--store", uri, env={
            **CREDENTIALS, "AWS_EC2_METADATA_DISABLED": "true"}, timeout=180), commands))
    assert procs[0].returncode == 2
    assert f"store {uri} is not writable" in error_line(procs[0].stderr)
    for proc in procs[1:]:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"cannot read store {uri}" in error_line(proc.stderr)
