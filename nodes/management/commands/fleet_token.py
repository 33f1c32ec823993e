"""`manage.py fleet_token`: create (default), list or revoke the tokens nodes join with."""

import os
import socket

from django.core.management.base import BaseCommand, CommandError

from nodes.models import FleetToken
from nodes.selectors import fleet_token_list
from nodes.services import fleet_token_create, fleet_token_revoke


def head_address() -> str:
    return os.environ.get("FLEET_PUBLIC_ADDRESS") or f"{socket.gethostname()}:8000"


class Command(BaseCommand):
    help = "Create a fleet token (printed once, with the node_join line to paste on a node), list or revoke tokens."

    def add_arguments(self, parser):
        parser.add_argument("--name", default="nodes", help="what the token is for (default: nodes)")
        parser.add_argument("--list", action="store_true", help="list tokens (secrets are never shown again)")
        parser.add_argument("--revoke", metavar="ID", help="revoke the token with this public id")
        parser.add_argument("--head", default=None, help="head address to print in the node_join line")

    def handle(self, *args, **options):
        if options["list"]:
            return self._list()
        if options["revoke"]:
            return self._revoke(options["revoke"])
        try:
            token, secret = fleet_token_create(name=options["name"])
        except ValueError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        head = options["head"] or head_address()
        self.stdout.write(f"Fleet token {token.name!r} created (id {token.public_id}). It is shown only this once.\n")
        self.stdout.write(f"  {secret}\n\nOn each node, run:\n")
        self.stdout.write(f"  python manage.py node_join {head} --model <path.gguf|smollm2> --token {secret}\n")

    def _list(self):
        tokens = list(fleet_token_list())
        if not tokens:
            self.stdout.write("No fleet tokens. Create one with: python manage.py fleet_token --name NAME\n")
            return
        self.stdout.write(f"{'ID':<14}{'NAME':<24}{'STATE':<10}{'CREATED':<22}LAST USED\n")
        for t in tokens:
            state = "active" if t.is_active else "revoked"
            used = t.last_used_at.strftime("%Y-%m-%d %H:%M:%S") if t.last_used_at else "never"
            self.stdout.write(
                f"{t.public_id:<14}{t.name[:22]:<24}{state:<10}{t.created_at:%Y-%m-%d %H:%M:%S}   {used}\n"
            )

    def _revoke(self, public_id: str):
        token = FleetToken.objects.filter(public_id=public_id).first()
        if token is None:
            raise CommandError(f"no fleet token with id {public_id!r}; see `manage.py fleet_token --list`",
                               returncode=2)
        if fleet_token_revoke(token=token):
            self.stdout.write(f"Revoked fleet token {public_id}; nodes using it are refused at their next handshake.\n")
        else:
            self.stdout.write(f"Fleet token {public_id} was already revoked.\n")
