"""A source that cannot be meant as written fails at once with what to change; no hub lookup for it."""

import os
import subprocess
import sys
import textwrap

import pytest

from lightning_disttrain.data import TokenDataModule, sources
from lightning_disttrain.data.sources import check_source, resolve_source


@pytest.fixture
def no_preparation(monkeypatch):
    """Fails the test if a source reaches `prepare`, where a hub name would be looked up."""
    def refuse(source, *args, **kwargs):
        raise AssertionError(f"prepare({source!r}) was called")

    monkeypatch.setattr(sources, "prepare", refuse)


@pytest.mark.parametrize("source, expected", [
    ("data/stdlb", r"'data/stdlb' does not exist \(data/ has no 'stdlb'; did you mean 'data/stdlib'\?\)"),
    ("data/stdlib/train_000.bin", r"data/stdlib/ has no 'train_000.bin'; it holds corpus.txt\)"),
    ("./corpus.txt", r"'./corpus.txt' does not exist \(./ has no 'corpus.txt'; it holds data/\)"),
    ("missing/deeper/x.jsonl", r"\./ has no 'missing'"),
    ("shards_*.bin", r"shard glob 'shards_\*.bin' matches no files"),
])
def test_missing_local_path_is_a_local_error(tmp_path, monkeypatch, no_preparation, source, expected):
    (tmp_path / "data" / "stdlib").mkdir(parents=True)
    (tmp_path / "data" / "stdlib" / "corpus.txt").write_text("text")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=expected) as info:  # no_preparation: never sent to the hub
        resolve_source(source, "bytes", cache_dir=tmp_path / "cache")
    if "glob" not in expected:
        assert "source takes 'embedded'" in str(info.value), "the message lists the accepted forms"


@pytest.mark.parametrize("word", ["embeded", "Embedded", "embeddd"])
def test_word_close_to_a_keyword_suggests_it(tmp_path, monkeypatch, no_preparation, word):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"source '{word}' is not a keyword.*did you mean source='embedded'\?"):
        TokenDataModule(source=word, tokenizer="bytes")  # at construction: before any process is launched
    with pytest.raises(ValueError, match="did you mean source='embedded'"):
        resolve_source(word, "bytes", cache_dir=tmp_path / "cache")


def test_what_is_left_for_the_hub(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "embeded").write_text("a local file wins over the spelling check")
    monkeypatch.chdir(tmp_path)
    assert check_source("HuggingFaceFW/fineweb-edu") == "hub"
    assert check_source("wikitext") == "hub"          # not close to a keyword
    assert check_source("embeded") == "local"         # exists here
    assert check_source("embedded") == "embedded"
    with pytest.raises(ValueError, match="does not exist"):
        check_source("data/fineweb-edu")             # ./data exists: a path in it, not the hub's org "data"


def test_hub_failure_names_the_source_offline(tmp_path):
    # A fresh interpreter, so that `datasets` and `huggingface_hub` read the offline switches at
    # import; any socket connection is recorded, so the test also proves nothing was contacted.
    script = textwrap.dedent("""
        import socket, sys
        attempts = []
        def refuse(self, address, *a, **k):
            attempts.append(address)
            raise OSError("network disabled in this test")
        socket.socket.connect = refuse
        socket.socket.connect_ex = refuse
        from lightning_disttrain.data.sources import resolve_source
        try:
            resolve_source("someorg/no-such-corpus", "bytes", cache_dir=sys.argv[1], prepare_kwargs={"num_proc": 1})
        except ValueError as e:
            print("ERROR:", e)
            print("CAUSE:", type(e.__cause__).__name__)
        print("ATTEMPTS:", attempts)
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=False, timeout=120)
    assert "ATTEMPTS: []" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "ERROR: source 'someorg/no-such-corpus' was taken for a Hugging Face dataset name" in out.stdout, \
        out.stdout + out.stderr[-3000:]
    assert "there is no 'someorg' here" in out.stdout and "HF_HUB_OFFLINE and HF_DATASETS_OFFLINE set" in out.stdout
    assert "CAUSE: ConnectionError" in out.stdout
    assert "Retrying" not in out.stderr, "offline mode fails at once, without retries"


@pytest.mark.parametrize("failure, expected", [
    ("unreachable", r"the hub could not be reached: ConnectError: \[Errno -2\] Name or service not known"),
    ("missing", r"there is no such dataset on the hub \(or it is private\): RepositoryNotFoundError"),
])
def test_a_hub_name_is_checked_once_before_datasets_retries(tmp_path, monkeypatch, no_preparation, failure, expected):
    # Online mode: one quick request for the dataset card; its failure (no network: DNS; or no such
    # dataset) is the error, before `datasets` would retry for half a minute. The hub's answer is
    # simulated here (tests must not contact it); no_preparation proves `datasets` never started.
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    def dataset_info(self, repo_id, **kwargs):
        assert repo_id == "data/stdlib" and kwargs.get("timeout")
        if failure == "unreachable":
            raise httpx.ConnectError("[Errno -2] Name or service not known")
        url = "https://huggingface.co/api/datasets/data/stdlib"
        raise RepositoryNotFoundError("404 Client Error: Repository Not Found",
                                      response=httpx.Response(404, request=httpx.Request("GET", url)))

    monkeypatch.setattr(HfApi, "dataset_info", dataset_info)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # no ./data here: "data/stdlib" has the shape of a hub name
    with pytest.raises(ValueError, match=r"source 'data/stdlib' was taken for a Hugging Face dataset name "
                                         r"\(there is no 'data' here .*\), and " + expected):
        resolve_source("data/stdlib", "bytes", cache_dir=tmp_path / "cache")
