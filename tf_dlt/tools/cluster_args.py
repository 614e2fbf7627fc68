"""The arguments commands that talk to a running cluster share (`tf-dlt
stats`, `tf-dlt reshard`, `tf-dlt abort-load`): its shards' addresses, token
and TLS."""

from __future__ import annotations

import argparse

from tf_dlt import errors
from tf_dlt.client import Client, address_list, read_token_file
from tf_dlt.tls import TlsConfig


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pservers", required=True, help="shard data-plane addresses, comma-separated, in order"
    )
    parser.add_argument("--auth-token-file", help="file holding the shards' token")
    parser.add_argument("--tls-ca", help="PEM CA of the shards' control plane (TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", help="PEM key of --tls-cert")


def addresses(args: argparse.Namespace) -> list[str]:
    return address_list(args.pservers)


def credentials(args: argparse.Namespace) -> tuple[str, TlsConfig | None]:
    """The token and the control plane's TLS the arguments name."""
    token = ""
    if args.auth_token_file:
        token = read_token_file(args.auth_token_file)
    if (args.tls_cert or args.tls_key) and not args.tls_ca:
        raise errors.InvalidArgumentError(
            "--tls-cert and --tls-key need --tls-ca (without it the client speaks plaintext)"
        )
    try:
        secure = TlsConfig(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
        if secure is not None:
            secure.channel_credentials()  # its files read now: a bad one named, not a traceback
    except ValueError as e:
        raise errors.InvalidArgumentError(str(e)) from None
    return token, secure


def client(args: argparse.Namespace) -> Client:
    """A client of the cluster the arguments name."""
    token, secure = credentials(args)
    return Client(addresses(args), auth_token=token, tls=secure)
