"""The embedded corpus: the stdlib's .py files in a fixed order, split by a hash of the path."""

import sysconfig

from lightning_disttrain.data import embedded_documents
from lightning_disttrain.data.embedded import embedded_files, embedded_split


def test_fixed_sorted_order_and_exclusions():
    files = embedded_files()
    relpaths = [f.relpath for f in files]
    assert relpaths == sorted(relpaths) and len(set(relpaths)) == len(relpaths)
    assert len(files) > 300 and all(p.endswith(".py") for p in relpaths)
    for excluded in ("site-packages", "test", "tests", "idle_test", "__pycache__"):
        assert not any(excluded in p.split("/")[:-1] for p in relpaths), excluded
    assert "os.py" in relpaths and "json/__init__.py" in relpaths
    root = sysconfig.get_paths()["stdlib"]
    assert all(str(f.path).startswith(root) for f in files)


def test_splits_are_disjoint_deterministic_and_about_two_percent():
    train, val = embedded_files("train"), embedded_files("val")
    assert {f.relpath for f in train}.isdisjoint(f.relpath for f in val)
    assert len(train) + len(val) == len(embedded_files())
    assert 0.005 < len(val) / (len(train) + len(val)) < 0.06
    assert all(embedded_split(f.relpath) == "val" for f in val)
    assert embedded_split("os.py") == embedded_split("os.py")


def test_embedded_documents_are_file_texts():
    first = embedded_files("val")[:3]
    assert list(embedded_documents("val", max_docs=3)) == [f.path.read_text(encoding="utf-8") for f in first]
