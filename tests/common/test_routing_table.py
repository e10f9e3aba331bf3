"""The routing table file: round trip, every load error, lookup, and the CSR plan against a slow reference; version
3's NO_EXPERT entries (a gated table: predictions first, then none) in each."""

from __future__ import annotations

import logging
import secrets
import struct
import zlib

import numpy as np
import pytest

from common.errors import InvalidRequestError, ModelFormatError
from common.models import config_from_hf
from common.routing_table import (
    HEADER_SIZE,
    HEADER_SIZES,
    NO_EXPERT,
    RoutingTable,
    RoutingTableError,
    write_routing_table,
)
from expert_service.tools.tiny_model import tiny_hf_config

CONFIG = config_from_hf(tiny_hf_config("mixtral"))  # 2 MoE layers, 259 tokens, 4 experts, top-2
L, V, E = len(CONFIG.moe_layers), CONFIG.vocab_size, CONFIG.num_experts
DIGEST = "sha256:" + secrets.token_hex(32)  # the model's colibri.json digest, fresh each run
DIGEST_AT = HEADER_SIZES[1]  # the model digest's offset in a version-2 header


def random_table(k: int = 2, seed: int = 0) -> np.ndarray:
    """[L, V, k] with distinct experts per token (a random permutation's first k)."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((L, V, E)), axis=2)[:, :, :k].astype(np.uint16)


def gated_table(k: int = 3, seed: int = 0) -> np.ndarray:
    """random_table with each token keeping a random number of its predictions (none to all), NO_EXPERT after."""
    table = random_table(k, seed)
    kept = np.random.default_rng(seed + 100).integers(0, k + 1, (L, V))
    table[np.arange(k)[None, None, :] >= kept[:, :, None]] = NO_EXPERT
    return table


@pytest.fixture
def table_file(tmp_path):
    path = tmp_path / "lut.bin"
    write_routing_table(path, random_table(), E, DIGEST)
    return path


def patch_header(path, index: int, value: int) -> None:
    """Overwrites uint32 field `index` (0 = version, ..., 5 = crc32) of the header."""
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 4 + 4 * index, value)
    path.write_bytes(bytes(data))


def expect_error(path, *fragments, digest: str | None = DIGEST):
    with pytest.raises(RoutingTableError) as info:
        RoutingTable.load(path, CONFIG, digest)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, ModelFormatError)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_round_trip(table_file):
    table = RoutingTable.load(table_file, CONFIG, DIGEST)
    np.testing.assert_array_equal(table.table, random_table())
    assert table.table.dtype == np.uint16 and table.table.shape == (L, V, 2)
    assert (table.top_k, table.num_experts, table.moe_layers) == (2, E, CONFIG.moe_layers)
    assert table.model_digest == DIGEST
    assert table_file.stat().st_size == HEADER_SIZE + L * V * 2 * 2
    data = table_file.read_bytes()
    assert struct.unpack_from("<I", data, 4) == (2,) and data[DIGEST_AT:HEADER_SIZE].hex() == DIGEST[len("sha256:") :]


def test_a_table_built_for_another_model_is_refused_naming_both_digests(table_file):
    """The header recorded no model: a table built for model A loaded against model B of the same shape."""
    other = "sha256:" + secrets.token_hex(32)
    message = expect_error(table_file, "model digest", DIGEST[:23], other[:23], "router-gen", digest=other)
    assert message.startswith(f"{table_file}: ")


def test_without_a_model_digest_only_the_shape_is_checked(table_file):
    """convert's keep_hot reads a table of an earlier conversion, for a model with no colibri.json yet."""
    assert RoutingTable.load(table_file, CONFIG, None).model_digest == DIGEST


def test_a_flipped_bit_in_the_model_digest_is_corruption_not_another_model(table_file):
    data = bytearray(table_file.read_bytes())
    data[DIGEST_AT + int(np.random.default_rng().integers(0, 32))] ^= 0x10
    table_file.write_bytes(bytes(data))
    expect_error(table_file, "crc32 of the model digest and the body")


def test_a_header_cut_inside_the_model_digest_is_refused(table_file):
    table_file.write_bytes(table_file.read_bytes()[: DIGEST_AT + 5])
    expect_error(table_file, "header size", f"is {DIGEST_AT + 5} bytes", f"expected {HEADER_SIZE} bytes")


@pytest.mark.parametrize("bad", ["", "sha256:" + "0" * 63, "SHA256:" + "0" * 64, "md5:" + "0" * 32])
def test_the_writer_refuses_a_malformed_model_digest(tmp_path, bad):
    with pytest.raises(ValueError, match="model_digest"):
        write_routing_table(tmp_path / "x.bin", random_table(), E, bad)
    assert not list(tmp_path.iterdir())


def test_a_version_1_table_still_loads_with_a_warning(tmp_path, caplog):
    """Tables written before the model digest load on their shape, whatever digest the model has."""
    write_raw(tmp_path / "v1.bin", random_table(seed=4), E)
    with caplog.at_level(logging.WARNING, logger="colibri.routing_table"):
        table = RoutingTable.load(tmp_path / "v1.bin", CONFIG, "sha256:" + secrets.token_hex(32))
    np.testing.assert_array_equal(table.table, random_table(seed=4))
    assert table.model_digest == "" and (table.top_k, table.num_experts) == (2, E)
    assert any("version 1 records no model" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("index, field, value", [(1, "num_layers", 5), (2, "vocab_size", 1000), (4, "num_experts", 8)])
def test_a_version_1_table_keeps_its_checks(tmp_path, index, field, value):
    path = tmp_path / "v1.bin"
    write_raw(path, random_table(), E)
    patch_header(path, index, value)
    expect_error(path, f"{field} is {value}")


def test_a_version_1_table_keeps_its_crc(tmp_path):
    path = tmp_path / "v1.bin"
    write_raw(path, random_table(), E)
    data = bytearray(path.read_bytes())
    data[HEADER_SIZES[1] + 3] ^= 0x01
    path.write_bytes(bytes(data))
    expect_error(path, "crc32 of the body")


def test_top_k_may_differ_from_the_model(tmp_path):
    path = tmp_path / "lut3.bin"
    write_routing_table(path, random_table(k=3), E, DIGEST)
    assert RoutingTable.load(path, CONFIG, DIGEST).top_k == 3


def test_bad_magic(table_file):
    data = bytearray(table_file.read_bytes())
    data[:4] = b"NOPE"
    table_file.write_bytes(bytes(data))
    expect_error(table_file, "magic", "b'NOPE'", "b'CLRT'")


def test_short_header(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"CLRT\x01\x00")
    expect_error(path, "header size", "6 bytes", f"{HEADER_SIZE} bytes")


def test_missing_file(tmp_path):
    expect_error(tmp_path / "absent.bin", "not found", "router-gen")


@pytest.mark.parametrize(
    "index, field, value, expected",
    [
        (0, "version", 7, "expected 1, 2 or 3"),
        (1, "num_layers", 5, f"expected {L}"),
        (2, "vocab_size", 1000, f"expected {V}"),
        (4, "num_experts", 8, f"expected {E}"),
        (3, "top_k", 0, f"expected 1..{E}"),
        (3, "top_k", 9, f"expected 1..{E}"),
    ],
)
def test_header_field_mismatch(table_file, index, field, value, expected):
    patch_header(table_file, index, value)
    expect_error(table_file, f"{field} is {value}", expected)


def test_truncated_body(table_file):
    data = table_file.read_bytes()
    table_file.write_bytes(data[:-10])
    body = L * V * 2 * 2
    expect_error(table_file, "body size", f"is {body - 10} bytes", f"expected {body} bytes")


def test_an_oversized_file_is_refused_before_its_body_is_read(table_file):
    """A valid header on a 64 GiB (sparse) file: the size is checked against the header before any byte of the
    body is read (reading it whole would need 64 GiB of memory), so a wrong file costs nothing whatever its size."""
    with open(table_file, "r+b") as f:
        f.truncate(HEADER_SIZE + (64 << 30))
    expect_error(table_file, "body size", f"is {64 << 30} bytes")


def test_trailing_bytes(table_file):
    table_file.write_bytes(table_file.read_bytes() + b"\0\0")
    expect_error(table_file, "body size", f"expected {L * V * 2 * 2} bytes")


def test_crc_mismatch(table_file):
    data = bytearray(table_file.read_bytes())
    data[HEADER_SIZE + 100] ^= 0x01
    table_file.write_bytes(bytes(data))
    crc = zlib.crc32(bytes(data[DIGEST_AT:]))  # the digest, then the body
    stored = struct.unpack_from("<I", data, 24)[0]
    expect_error(table_file, "crc32", f"is {crc:#010x}", f"expected {stored:#010x}")


def write_raw(path, table: np.ndarray, num_experts: int, digest: str | None = None, version: int = 0) -> None:
    """Writes a table bypassing the writer's checks, with a correct crc: version 1 without a digest, else 2 (or
    `version`)."""
    body = table.astype("<u2").tobytes()
    recorded = bytes.fromhex(digest.removeprefix("sha256:")) if digest else b""
    crc = zlib.crc32(recorded + body)
    version = version or (2 if digest else 1)
    path.write_bytes(
        struct.pack("<4s6I", b"CLRT", version, *table.shape[:2], table.shape[2], num_experts, crc) + recorded + body
    )


def test_entry_out_of_range(tmp_path):
    table = random_table()
    table[1, 42, 1] = 9
    write_raw(tmp_path / "bad.bin", table, E, DIGEST)
    expect_error(tmp_path / "bad.bin", "layer 1", "token 42", "slot 1", "is 9", f"< num_experts={E}")


def test_duplicate_entries(tmp_path):
    table = random_table()
    table[0, 7] = [3, 3]
    write_raw(tmp_path / "dup.bin", table, E, DIGEST)
    expect_error(tmp_path / "dup.bin", "layer 0", "token 7", "[3, 3]", "distinct")


def test_writer_rejects_out_of_range(tmp_path):
    with pytest.raises(ValueError):
        write_routing_table(tmp_path / "x.bin", np.full((L, V, 2), E, dtype=np.uint16), E, DIGEST)


def test_lookup(table_file):
    table = RoutingTable.load(table_file, CONFIG, DIGEST)
    ids = np.array([5, 258, 5, 0])
    out = table.lookup(ids)
    assert out.shape == (L, 4, 2)
    for l in range(L):
        for t, token in enumerate(ids):
            np.testing.assert_array_equal(out[l, t], table.table[l, token])
    with pytest.raises(InvalidRequestError, match="259"):
        table.lookup(np.array([1, 259]))
    with pytest.raises(InvalidRequestError, match="-1"):
        table.lookup(np.array([-1]))


def reference_plan(table: RoutingTable, token_ids) -> list[tuple[list[int], list[int]]]:
    """Slow and obvious: walk the tokens in order, append each to its experts' lists (a NO_EXPERT entry to none);
    each row padded with -1 to the step's T*k."""
    plans = []
    for l in range(table.table.shape[0]):
        lists = [[] for _ in range(table.num_experts)]
        for t, token in enumerate(token_ids):
            for e in table.table[l, token]:
                if e != NO_EXPERT:
                    lists[int(e)].append(t)
        offsets = [0]
        for tokens in lists:
            offsets.append(offsets[-1] + len(tokens))
        indices = [t for tokens in lists for t in tokens]
        plans.append((offsets, indices + [-1] * (len(token_ids) * table.top_k - len(indices))))
    return plans


def assert_plan_matches(table: RoutingTable, token_ids) -> list:
    plan = [(offsets, indices) for _, offsets, indices in table.routing_plan(np.asarray(token_ids)).csr()]
    expected = reference_plan(table, token_ids)
    assert len(plan) == len(expected)
    for (offsets, indices), (ref_offsets, ref_indices) in zip(plan, expected):
        assert offsets.dtype == np.int32 and indices.dtype == np.int32
        assert offsets.shape == (table.num_experts + 1,) and indices.shape == (len(token_ids) * table.top_k,)
        np.testing.assert_array_equal(offsets, ref_offsets)
        np.testing.assert_array_equal(indices, ref_indices)
    return plan


@pytest.mark.parametrize("seed", range(5))
def test_plan_matches_reference_on_random_ids(table_file, seed):
    rng = np.random.default_rng(seed)
    table = RoutingTable.load(table_file, CONFIG, DIGEST)
    ids = rng.integers(0, 20, size=int(rng.integers(1, 60)))  # few distinct ids: many repeats
    assert_plan_matches(table, ids)


def test_plan_with_experts_that_get_no_tokens(tmp_path):
    table = random_table(k=1)
    table[:, :, 0] = 2  # every token -> expert 2 only
    write_routing_table(tmp_path / "one.bin", table, E, DIGEST)
    lut = RoutingTable.load(tmp_path / "one.bin", CONFIG, DIGEST)
    plan = assert_plan_matches(lut, [9, 9, 4])
    offsets, indices = plan[0]
    np.testing.assert_array_equal(offsets, [0, 0, 0, 3, 3])
    np.testing.assert_array_equal(indices, [0, 1, 2])


def test_plan_empty_step(table_file):
    plan = RoutingTable.load(table_file, CONFIG, DIGEST).routing_plan(np.zeros(0, dtype=np.int64))
    assert all(o.tolist() == [0] * (E + 1) and i.size == 0 for _, o, i in plan.csr())


def test_plan_for_a_mixed_prefill_and_decode_batch(table_file):
    """A step as the router builds it: two prompt chunks and three single decode tokens, concatenated."""
    table = RoutingTable.load(table_file, CONFIG, DIGEST)
    prompt_a, prompt_b = [10, 11, 12, 10, 13], [200, 201]
    decodes = [10, 77, 258]
    ids = prompt_a + prompt_b + decodes
    plan = assert_plan_matches(table, ids)
    for l, (offsets, indices) in enumerate(plan):
        for e in range(E):
            for t in indices[offsets[e] : offsets[e + 1]]:
                assert e in table.table[l, ids[t]]  # every listed token predicts that expert
        assert np.bincount(indices, minlength=len(ids)).tolist() == [2] * len(ids)  # each token k times


def test_random_corruptions_are_refused_in_one_line_or_load_a_valid_table(tmp_path):
    """Seeded fuzz over the file's bytes: cut anywhere, bytes appended, header words or body entries rewritten
    (with the crc fixed up, so the entry checks are reached). Every outcome is a one-line RoutingTableError or a
    table whose every entry is < num_experts and distinct within a token."""
    rng = np.random.default_rng(11)
    good = write_routing_table(tmp_path / "good.bin", random_table(k=3), E, DIGEST).read_bytes()
    path = tmp_path / "fuzz.bin"
    refused = 0
    for trial in range(300):
        data = bytearray(good)
        kind = trial % 4
        if kind == 0:
            data = data[: int(rng.integers(0, len(data)))]
        elif kind == 1:
            data += bytes(rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8))
        elif kind == 2:
            struct.pack_into("<I", data, 4 * int(rng.integers(1, 15)), int(rng.integers(0, 2**32)))  # digest too
        else:
            body = np.frombuffer(data, "<u2", offset=HEADER_SIZE).copy()
            body[rng.integers(0, body.size, int(rng.integers(1, 4)))] = rng.choice([0, 1, E - 1, E, 2**16 - 1])
            data[HEADER_SIZE:] = body.tobytes()
            struct.pack_into("<I", data, 24, zlib.crc32(bytes(data[DIGEST_AT:])))
        path.write_bytes(bytes(data))
        try:
            table = RoutingTable.load(path, CONFIG, DIGEST)
        except RoutingTableError as error:
            assert "\n" not in str(error) and str(error).startswith(str(path))
            refused += 1
            continue
        assert int(table.table.max()) < E
        ordered = np.sort(table.table, axis=2)
        assert not (ordered[:, :, 1:] == ordered[:, :, :-1]).any()
    assert refused > 200


def test_an_unreadable_table_is_one_line(table_file, monkeypatch):
    """A model directory's routing_table.bin the worker may not read stopped it with a PermissionError traceback
    (the sandbox runs as root, so the refusal is simulated)."""
    from common import routing_table

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(routing_table, "open_regular", refuse)
    expect_error(table_file, f"{table_file}: routing table cannot be read: Permission denied")


@pytest.mark.parametrize("where", ["a directory", "a missing directory"])
def test_a_failed_write_names_the_table_and_leaves_no_tmp(tmp_path, where):
    path = tmp_path / "out.bin"
    if where == "a directory":
        path.mkdir()
    else:
        path = tmp_path / "missing" / "out.bin"
    with pytest.raises(OSError) as e:
        write_routing_table(path, random_table(), E, DIGEST)
    assert e.value.filename == str(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out.bin"] if where == "a directory" else [])


# --- version 3: NO_EXPERT entries --------------------------------------------------------------------------


def test_a_gated_table_round_trips_as_version_3(tmp_path):
    """A table with NO_EXPERT entries is written as version 3, one without as version 2 (what every earlier
    reader loads), and loads back equal either way."""
    gated = gated_table()
    assert (gated == NO_EXPERT).any() and (gated != NO_EXPERT).any()
    path = write_routing_table(tmp_path / "gated.bin", gated, E, DIGEST)
    assert struct.unpack_from("<I", path.read_bytes(), 4) == (3,) and path.stat().st_size == HEADER_SIZE + gated.nbytes
    table = RoutingTable.load(path, CONFIG, DIGEST)
    np.testing.assert_array_equal(table.table, gated)
    assert (table.top_k, table.model_digest, table.complete) == (3, DIGEST, False)
    full = write_routing_table(tmp_path / "full.bin", random_table(k=3), E, DIGEST)
    assert struct.unpack_from("<I", full.read_bytes(), 4) == (2,) and RoutingTable.load(full, CONFIG, DIGEST).complete
    all_none = write_routing_table(tmp_path / "none.bin", np.full((L, V, 2), NO_EXPERT, np.uint16), E, DIGEST)
    assert not RoutingTable.load(all_none, CONFIG, DIGEST).complete  # a table may predict nothing at all


def test_a_version_2_file_written_by_hand_still_loads(tmp_path):
    write_raw(tmp_path / "v2.bin", random_table(seed=8), E, DIGEST, version=2)
    np.testing.assert_array_equal(RoutingTable.load(tmp_path / "v2.bin", CONFIG, DIGEST).table, random_table(seed=8))


@pytest.mark.parametrize(
    "row, version, fragments",
    [
        ([NO_EXPERT, 1, 2], 3, ["experts of [layer 1 (model layer 1), token 42]", "predictions first, then NO_EXPERT"]),
        ([1, NO_EXPERT, 2], 3, ["[1, 65535, 2]", "predictions first"]),
        ([2, 2, NO_EXPERT], 3, ["[2, 2, 65535]", "distinct expert ids"]),
        ([3, E, NO_EXPERT], 3, ["entry [layer 1 (model layer 1), token 42, slot 1] is 4", f"< num_experts={E}"]),
        ([3, 1, NO_EXPERT], 2, ["slot 2] is 65535", f"< num_experts={E} (NO_EXPERT=65535 needs version 3)"]),
    ],
)
def test_each_entry_check_of_a_gated_table_is_one_line(tmp_path, row, version, fragments):
    """A real entry after NO_EXPERT, a duplicate, an id out of range, and NO_EXPERT in a version-2 file."""
    table = gated_table() if version == 3 else random_table(k=3)
    table[1, 42] = row
    write_raw(tmp_path / "bad.bin", table, E, DIGEST, version=version)
    expect_error(tmp_path / "bad.bin", *fragments)


def test_repeated_no_expert_entries_are_no_duplicates(tmp_path):
    table = random_table(k=3)
    table[0, 5] = [2, NO_EXPERT, NO_EXPERT]
    table[1, 6] = [NO_EXPERT] * 3
    write_raw(tmp_path / "ok.bin", table, E, DIGEST, version=3)
    np.testing.assert_array_equal(RoutingTable.load(tmp_path / "ok.bin", CONFIG, DIGEST).table, table)


@pytest.mark.parametrize("row", [[NO_EXPERT, 1], [1, 1], [E, NO_EXPERT]])
def test_the_writer_refuses_what_the_reader_would(tmp_path, row):
    table = random_table()
    table[0, 9] = row
    with pytest.raises(ValueError, match=r"^(experts of|entry) \[layer 0, token 9"):
        write_routing_table(tmp_path / "x.bin", table, E, DIGEST)
    assert not list(tmp_path.iterdir())


def test_lookup_and_plan_of_a_gated_table(tmp_path):
    """The lookup keeps NO_EXPERT; the plan lists each token under its real predictions only, each row padded
    with -1 after them, and the worker reads it back as each token's predictions, -1 for the rest."""
    path = write_routing_table(tmp_path / "gated.bin", gated_table(seed=3), E, DIGEST)
    table = RoutingTable.load(path, CONFIG, DIGEST)
    rng = np.random.default_rng(3)
    for _ in range(5):
        ids = rng.integers(0, 30, size=int(rng.integers(1, 40)))
        np.testing.assert_array_equal(table.lookup(ids), table.table[:, ids])
        assert_plan_matches(table, ids)
        planned = table.routing_plan(ids).expert_ids(E, len(ids))
        for l, layer in enumerate(CONFIG.moe_layers):
            expected = [sorted(int(e) for e in row if e != NO_EXPERT) for row in table.table[l, ids]]
            got = [[int(e) for e in row if e >= 0] for row in planned[layer]]
            assert got == expected
            assert all(list(row[len(e) :]) == [-1] * (table.top_k - len(e)) for row, e in zip(planned[layer], got))
    with pytest.raises(InvalidRequestError, match="every token needs 3 experts"):  # a routing needs all k
        table.routing_plan(np.arange(30)).expert_ids(E, 30, 3)


def test_random_corruptions_of_a_gated_table_are_refused_or_valid(tmp_path):
    """Seeded fuzz over a version-3 body (entries rewritten, the crc fixed up): a one-line refusal, or a table
    whose rows are predictions first (distinct, < num_experts), NO_EXPERT after them."""
    rng = np.random.default_rng(12)
    good = write_routing_table(tmp_path / "good.bin", gated_table(seed=5), E, DIGEST).read_bytes()
    path, refused = tmp_path / "fuzz.bin", 0
    for _ in range(200):
        data = bytearray(good)
        body = np.frombuffer(data, "<u2", offset=HEADER_SIZE).copy()
        body[rng.integers(0, body.size, int(rng.integers(1, 4)))] = rng.choice([0, 1, E - 1, E, NO_EXPERT])
        data[HEADER_SIZE:] = body.tobytes()
        struct.pack_into("<I", data, 24, zlib.crc32(bytes(data[DIGEST_AT:])))
        path.write_bytes(bytes(data))
        try:
            table = RoutingTable.load(path, CONFIG, DIGEST).table
        except RoutingTableError as error:
            assert "\n" not in str(error) and str(error).startswith(str(path))
            refused += 1
            continue
        for row in table.reshape(-1, table.shape[2]).tolist():
            real = [e for e in row if e != NO_EXPERT]
            assert row[: len(real)] == real and len(set(real)) == len(real) and all(e < E for e in real)
    assert 20 < refused < 200
