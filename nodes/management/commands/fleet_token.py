"""`manage.py fleet_token`: create (default), list or revoke the tokens nodes join with."""

import re
from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from nodes.link.handshake import fingerprint
from nodes.link.noise import public_key
from nodes.models import FleetToken
from nodes.selectors import fleet_token_list
from nodes.services import (
    JoinRefused,
    fleet_token_create,
    fleet_token_head_address,
    fleet_token_join_lines,
    fleet_token_revoke,
    head_static_key,
)

_DURATION = re.compile(r"(\d+)([mhd])")
_UNITS = {"m": "minutes", "h": "hours", "d": "days"}


class Command(BaseCommand):
    help = "Create a fleet token (printed once, with the node_join line to paste on a node), list or revoke tokens."

    def add_arguments(self, parser):
        parser.add_argument("--name", default="nodes", help="what the token is for (default: nodes)")
        parser.add_argument("--list", action="store_true", help="list tokens (secrets are never shown again)")
        parser.add_argument("--revoke", metavar="ID", help="revoke the token with this public id")
        parser.add_argument("--head", default=None, help="head address to print in the node_join line (default: "
                            "FLEET_PUBLIC_ADDRESS, else the address `manage.py up` is bound to)")
        parser.add_argument("--expires-in", metavar="DURATION",
                            help="no new joins with it after this long: 30m, 12h, 90d (default: never)")

    def handle(self, *args, **options):
        if options["list"]:
            return self._list()
        if options["revoke"]:
            return self._revoke(options["revoke"])
        expires_at = _expiry(options["expires_in"]) if options["expires_in"] else None
        try:
            token, secret = fleet_token_create(name=options["name"], expires_at=expires_at)
        except ValueError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        head, warning = (options["head"], None) if options["head"] else fleet_token_head_address()
        until = f", valid until {expires_at:%Y-%m-%d %H:%M} UTC" if expires_at else ""
        self.stdout.write(f"Fleet token {token.name!r} created (id {token.public_id}{until}). "
                          "It is shown only this once.\n")
        self.stdout.write(f"  {secret}\n\n" + "\n".join(fleet_token_join_lines(head=head, secret=secret)) + "\n")
        if warning:
            self.stderr.write(f"warning: {warning}\n")
        try:
            self.stdout.write(f"\nNodes pin the head's link key at their first join: {_head_fingerprint()}\n")
        except JoinRefused as exc:
            self.stderr.write(f"warning: {exc.reason}\n")

    def _list(self):
        tokens = list(fleet_token_list())
        if not tokens:
            self.stdout.write("No fleet tokens. Create one with: python manage.py fleet_token --name NAME\n")
            return
        self.stdout.write(f"{'ID':<14}{'NAME':<24}{'STATE':<10}{'CREATED':<22}LAST USED\n")
        for t in tokens:
            state = "active" if t.is_active else "revoked" if t.revoked_at else "expired"
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
            self.stdout.write(f"Revoked fleet token {public_id}; the links of nodes that joined with it are closing.\n")
        else:
            self.stdout.write(f"Fleet token {public_id} was already revoked.\n")


def _expiry(text: str):
    match = _DURATION.fullmatch(text.strip())
    if not match or int(match.group(1)) < 1:
        raise CommandError(f"--expires-in {text!r}: give a number and a unit, like 30m, 12h or 90d", returncode=2)
    return timezone.now() + timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


def _head_fingerprint() -> str:
    return fingerprint(public_key(head_static_key()))
