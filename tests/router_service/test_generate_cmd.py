"""`colibri generate`'s flags: an integer its proto field cannot hold, a token gRPC metadata cannot carry, a token
or TLS file that cannot serve, each is a one-line ConfigError naming the flag, raised before anything connects (the
router checks the values' meaning: --top-logprobs over 20, ...)."""

import argparse
import os
import random
import string

import pytest

from colibri import cli
from common.errors import ConfigError
from router_service import generate_cmd
from router_service.client import connection
from tests.router_service.certs import issue, make_ca

UINT32_FLAGS = ["--max-new-tokens", "--min-new-tokens", "--top-k", "--top-logprobs", "--stop-token-id"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate_cmd.add_arguments(parser)
    return parser.parse_args(["--target", "127.0.0.1:1", "--timeout", "0.5", *argv])


@pytest.mark.parametrize("flag", UINT32_FLAGS)
def test_an_integer_flag_out_of_its_field_range_names_the_flag(flag):
    rng = random.Random()
    for value in (-rng.randrange(1, 1 << 40), (1 << 32) + rng.randrange(1 << 40)):
        with pytest.raises(ConfigError) as e:
            generate_cmd.run(parse("--tokens", "1,2", f"{flag}={value}"))
        assert str(e.value) == f"{flag} must be in [0, {(1 << 32) - 1}], got {value}"


def test_seed_and_token_ids_out_of_range_name_the_flag():
    for argv, message in [
        (["--tokens", "1,2", "--seed=-3"], "--seed must be in [0, 18446744073709551615], got -3"),
        (["--tokens", f"5,{1 << 32}"], f"--tokens[1] must be in [0, 4294967295], got {1 << 32}"),
    ]:
        with pytest.raises(ConfigError) as e:
            generate_cmd.run(parse(*argv))
        assert str(e.value) == message


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["\udcff\udcfe"], "the prompt"),
        (["--chat", "hi", "--system", "ok \udce9"], "--system"),
        (["--stop", "a", "--stop", "\udcff", "hi"], "--stop"),
    ],
)
def test_text_that_is_not_utf8_names_the_flag(argv, flag):
    # Python hands command-line bytes that are not UTF-8 over as lone surrogates, which protobuf cannot encode.
    with pytest.raises(ConfigError) as e:
        generate_cmd.run(parse(*argv))
    assert str(e.value).startswith(f"{flag} is not UTF-8 text"), e.value


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e10"])
def test_a_timeout_grpc_would_take_as_already_passed_names_the_flag(value):
    args = parse("--tokens", "1,2")
    args.timeout = float(value)
    with pytest.raises(ConfigError) as e:
        generate_cmd.run(args)
    assert str(e.value).startswith("--timeout must be in (0, 1e+09] seconds"), e.value


def test_errors_print_as_every_subcommand_does(capsys):
    """docs/cli.md: `colibri SUBCOMMAND: error: MESSAGE`, once, whether the flags or the call failed."""
    assert cli.main(["generate", "--chat", "--tokens", "1"]) == 2
    assert capsys.readouterr().err == "colibri generate: error: --chat needs a text prompt (the user message)\n"
    assert cli.main(["generate", "--target", "127.0.0.1:1", "--timeout", "5", "hi"]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("colibri generate: error: UNAVAILABLE: "), line


@pytest.mark.parametrize("tokens", ["١,٢", "1_0", "1,,2", ",", "1,2 3", "0x10", " "])
def test_token_ids_that_are_no_comma_separated_decimals_are_refused(tokens):
    """Python's int() read other scripts' digits (١ as 1) and underscores (1_0 as 10) as ids, and an empty item
    (1,,2) was dropped without a word: a prompt other than the one typed was sent."""
    with pytest.raises(ConfigError) as e:
        generate_cmd.run(parse("--tokens", tokens))
    assert str(e.value).startswith("--tokens: "), e.value


def test_token_ids_may_have_spaces_around_commas_and_one_trailing_comma():
    from common.token_ids import parse_id_list

    ids = [random.randrange(1 << 32) for _ in range(random.randrange(1, 20))]
    assert parse_id_list(" , ".join(map(str, ids)) + ",") == ids


def test_an_empty_target_is_the_default_from_the_environment_and_refused_as_a_flag(monkeypatch):
    """COLIBRI_TARGET set empty (an unset variable in a manifest) was dialled as the address ''."""
    monkeypatch.setenv("COLIBRI_TARGET", "")
    parser = argparse.ArgumentParser()
    generate_cmd.add_arguments(parser)
    assert parser.parse_args(["--tokens", "1"]).target == "localhost:50051"
    with pytest.raises(ConfigError) as e:
        generate_cmd.run(parser.parse_args(["--tokens", "1", "--target", ""]))
    assert str(e.value).startswith("--target: empty"), e.value


# --- the token and TLS files: refused before anything connects, naming the flag ----------------------------------


def refusal(*argv: str) -> str:
    with pytest.raises(ConfigError) as e:
        generate_cmd.run(parse("--tokens", "1", *argv))
    return str(e.value)


@pytest.mark.timeout(120)  # opening the FIFO would wait for a writer for ever
def test_a_token_file_that_cannot_serve_is_refused_naming_the_flag(tmp_path):
    """The errors were Python's (`[Errno 2] No such file or directory: '...'`), and a FIFO blocked for ever."""
    name = tmp_path / f"token-{random.randrange(1 << 30)}"
    assert refusal("--token-file", str(name)) == f"--token-file: cannot read {name}: No such file or directory"
    os.mkfifo(name)
    assert refusal("--token-file", str(name)) == f"--token-file: cannot read {name}: not a regular file (a FIFO)"
    name.unlink()
    name.write_text("# only a comment\n\n")
    assert refusal("--token-file", str(name)) == f"--token-file: {name} holds no token (one per line)"
    name.write_bytes(b"t0k\xffen\n")
    assert refusal("--token-file", str(name)).startswith(f"--token-file: {name}, line 1: byte 0xff at position 3 ")


def test_a_token_grpc_metadata_cannot_carry_is_refused_naming_the_flag():
    """A newline or another control character inside the token failed the call as `INTERNAL: Invalid metadata`."""
    rng = random.Random()
    secret = "".join(rng.choice(string.ascii_letters) for _ in range(rng.randrange(16, 40)))
    at = rng.randrange(8, len(secret) - 7)  # both halves long enough not to occur in the message by chance
    bad = rng.choice(["\n", "\r", "\x00", "\x1b", "\x7f", "é"])
    message = refusal("--token", secret[:at] + bad + secret[at:])
    assert message.startswith(f"--token (or COLIBRI_AUTH_TOKEN): byte 0x{bad.encode()[0]:02x} at position {at} ")
    assert secret[:at] not in message and secret[at:] not in message  # a secret is never printed


def test_a_token_gets_the_whitespace_around_it_stripped_as_the_router_strips_its_own():
    token = "".join(random.choice(string.ascii_letters + string.digits) for _ in range(20))
    metadata, _, _ = connection(f" {token}\n", "", False, "", "", "", "", 1 << 20)
    assert metadata == (("authorization", f"Bearer {token}"),)


def test_tls_files_that_are_no_pem_are_refused_at_start_naming_the_flag(tmp_path):
    """A CA file that is no PEM failed only as the connection was made, reading as a router that is down."""
    junk = tmp_path / "ca.pem"
    junk.write_bytes(random.randbytes(random.randrange(1, 4096)))
    assert (
        refusal("--tls-ca", str(junk))
        == f"--tls-ca: {junk} holds no PEM certificate (-----BEGIN CERTIFICATE----- blocks)"
    )
    ca, other = make_ca(), make_ca()
    (tmp_path / "ok.pem").write_bytes(ca.cert)
    client = issue(ca, "client", server=False)
    (tmp_path / "c.crt").write_bytes(client.cert)
    (tmp_path / "k.key").write_bytes(issue(other, "client", server=False).key)  # another certificate's key
    message = refusal(
        "--tls-ca",
        str(tmp_path / "ok.pem"),
        "--tls-cert",
        str(tmp_path / "c.crt"),
        "--tls-key",
        str(tmp_path / "k.key"),
    )
    assert message.startswith(
        f"--tls-cert, --tls-key: {tmp_path / 'c.crt'}, {tmp_path / 'k.key'}: the certificate and key do not form a pair"
    ), message
    (tmp_path / "k.key").write_bytes(client.key)
    _, _, credentials = connection(
        "", "", False, str(tmp_path / "ok.pem"), str(tmp_path / "c.crt"), str(tmp_path / "k.key"), "", 1 << 20
    )
    assert credentials is not None
