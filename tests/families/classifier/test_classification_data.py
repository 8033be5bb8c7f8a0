"""Reading classification data in every supported format, and mapping labels onto the model's."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from headsweep.errors import HeadsweepError
from headsweep.workers.families.hf_classifier.adapter import label_ids
from headsweep.workers.families.hf_classifier.config import ClassifierData
from headsweep.workers.families.hf_classifier.data import read_examples

ROWS = [("a man sleeps", "a person rests", "entailment"), ('he said "no"', "nobody spoke", "contradiction")]


def write(tmp_path, fmt):
    if fmt == "tsv":
        p = tmp_path / "d.tsv"
        p.write_text("premise\thypothesis\tlabel\n" + "".join(f"{a}\t{b}\t{c}\n" for a, b, c in ROWS))
    elif fmt == "csv":
        p = tmp_path / "d.csv"
        p.write_text("premise,hypothesis,label\n" + "".join(f'{a},"{b}",{c}\n' for a, b, c in ROWS[:1])
                     + 'he said ""no"",nobody spoke,contradiction\n'.replace('he said ""no""', '"he said ""no"""'))
    elif fmt == "jsonl":
        p = tmp_path / "d.jsonl"
        p.write_text("".join(json.dumps({"premise": a, "hypothesis": b, "label": c}) + "\n" for a, b, c in ROWS))
    else:
        p = tmp_path / "d.parquet"
        pq.write_table(pa.table({"premise": [r[0] for r in ROWS], "hypothesis": [r[1] for r in ROWS],
                                 "label": [r[2] for r in ROWS]}), p)
    return p


@pytest.mark.parametrize("fmt", ["tsv", "csv", "jsonl", "parquet"])
def test_sentence_pairs_in_every_format(tmp_path, fmt):
    cfg = ClassifierData(path=str(write(tmp_path, fmt)), text_column="premise", text_pair_column="hypothesis")
    ex = read_examples(cfg)
    assert ex.texts == [r[0] for r in ROWS]
    assert ex.text_pairs == [r[1] for r in ROWS]
    assert ex.labels == [r[2] for r in ROWS]
    assert ex.ids == ["0", "1"]


def test_labels_by_name_or_id():
    id2label = {0: "contradiction", 1: "entailment", 2: "neutral"}
    assert label_ids(["entailment", "neutral"], id2label, "f") == [1, 2]
    assert label_ids(["2", "0"], id2label, "f") == [2, 0]
    with pytest.raises(HeadsweepError, match=r"labels outside the model's label set: '3' in row 2, 'maybe' in row 3"):
        label_ids(["1", "3", "maybe"], id2label, "f")


def test_unknown_format_and_duplicate_ids(tmp_path):
    p = tmp_path / "d.txt"
    p.write_text("x")
    with pytest.raises(HeadsweepError, match="set data.format"):
        read_examples(ClassifierData(path=str(p)))
    q = tmp_path / "d.tsv"
    q.write_text("id\tsentence\tlabel\n1\ta\t0\n1\tb\t1\n")
    with pytest.raises(HeadsweepError, match="duplicate ids"):
        read_examples(ClassifierData(path=str(q), id_column="id"))


def test_text_is_read_as_text(tmp_path):
    """Columns are strings as written (an id 007 stays 007), a UTF-8 byte order mark is no part of the header,
    and Parquet ``binary`` text is decoded strictly with ``data.encoding`` (not turned into "b'...'")."""
    tsv = tmp_path / "d.tsv"
    tsv.write_bytes("\ufeffid\tsentence\tlabel\n007\tcafé\t1\n".encode())
    ex = read_examples(ClassifierData(path=str(tsv), id_column="id"))
    assert (ex.ids, ex.texts, ex.labels) == (["007"], ["café"], ["1"])
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"sentence": pa.array([b"ok", b"caf\xe9"], pa.binary()), "label": [1, 0]}), parquet)
    with pytest.raises(HeadsweepError, match=r"column 'sentence' row 2 is not valid utf-8 text \(byte 0xe9 at byte "
                                             r"offset 3 of the value\)"):
        read_examples(ClassifierData(path=str(parquet)))
    assert read_examples(ClassifierData(path=str(parquet), encoding="latin-1")).texts == ["ok", "café"]
