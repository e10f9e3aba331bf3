"""Shared fixtures: a byte-level tokenizer.json where token id == byte value (+ special tokens)."""
import pytest

EOS_ID = 256
BOS_ID = 257
VOCAB_SIZE = 258


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer/decoder use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_byte_tokenizer(path) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<bos>", special=True)])
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
    return write_byte_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path):
    from router_service.tokenizer import Tokenizer
    tok = Tokenizer.from_file(tokenizer_path)
    assert tok.vocab_size == VOCAB_SIZE and tok.encode("<eos>") == [EOS_ID]
    return tok
