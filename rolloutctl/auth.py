"""Tokens for the API (stored hashed on the server, with an expiry).

    rolloutctl login --username NAME      prints a new token (password from ROLLOUTCTL_PASSWORD or a prompt);
                                          use it as ROLLOUTCTL_TOKEN. Its expiry goes to stderr.
    rolloutctl logout                     revokes the token in ROLLOUTCTL_TOKEN / --token
"""
from __future__ import annotations

import getpass
import os
import sys

from . import EXIT_OK, EXIT_USAGE

COMMANDS = ("login", "logout")


def add_parsers(sub, add_connection) -> None:
    p = sub.add_parser("login", help="get a new API token for a username and password (prints the token)")
    add_connection(p)
    p.add_argument("--username", default=os.environ.get("ROLLOUTCTL_USERNAME"), help="env ROLLOUTCTL_USERNAME")
    p = sub.add_parser("logout", help="revoke the API token this command is given")
    add_connection(p)


def run(client, args) -> int:
    if args.command == "login":
        if not args.username:
            print("rolloutctl: login needs --username (or ROLLOUTCTL_USERNAME)", file=sys.stderr)
            return EXIT_USAGE
        password = os.environ.get("ROLLOUTCTL_PASSWORD")
        if password is None:
            password = getpass.getpass(f"password for {args.username}: ")
        client.session.headers.pop("Authorization", None)  # a login sends credentials, not a token
        _, out = client.post_json("auth/token/", {"username": args.username, "password": password})
        print(out["token"], flush=True)
        print(f"rolloutctl: token for {args.username}, valid until {out['expiry']}", file=sys.stderr)
        return EXIT_OK
    if args.command == "logout":
        client.request("DELETE", "auth/token/", retry=False, expect=(204,))
        print("rolloutctl: token revoked", file=sys.stderr)
        return EXIT_OK
    raise ValueError(args.command)
